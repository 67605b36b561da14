//! Op kernels, one module per family. Each module's `register` adds its kernels.

pub mod blockmm;
pub mod common;
pub mod contrib;
pub mod contrib_attention;
pub mod control;
pub mod conv;
pub mod elementwise;
pub mod fused;
pub mod gather;
pub mod matmul;
pub mod misc;
pub mod norm;
pub mod qconv;
pub mod qlinear;
pub mod qsoftmax;
pub mod quant;
pub mod real;
pub mod reduce;
pub mod rnn;
pub mod sequence;
pub mod shape;
pub mod signal;
pub mod text;
pub mod vision;

use crate::kernel::Registry;

pub fn register_all(r: &mut Registry) {
    blockmm::register(r);
    contrib::register(r);
    control::register(r);
    conv::register(r);
    elementwise::register(r);
    fused::register(r);
    gather::register(r);
    matmul::register(r);
    misc::register(r);
    norm::register(r);
    qlinear::register(r);
    qsoftmax::register(r);
    quant::register(r);
    reduce::register(r);
    rnn::register(r);
    sequence::register(r);
    shape::register(r);
    signal::register(r);
    text::register(r);
    vision::register(r);
}
