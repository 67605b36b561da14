//! Graph optimization passes (see the pass manager). Placeholder module list: filled in by the
//! passes work.
