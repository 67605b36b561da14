use crate::kernel::Registry;

pub fn register(_r: &mut Registry) {}
