//! The passes, one module each.

pub mod attention_fusion;
pub mod const_fold;
pub mod conv_fold;
pub mod cse;
pub mod dce;
pub mod fuse;
pub mod gelu;

pub mod identity;
pub mod layout;
pub mod norm_fusion;

pub mod reshape;

#[cfg(test)]
pub(crate) mod testutil;
