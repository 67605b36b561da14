//! Element counts of shapes (a leaf module: tensors, errors and inference all use it).

/// Element count of a shape already known to fit (a tensor's own shape). Shapes read from a
/// file or a flag go through [`checked_numel`] first.
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Element count of `shape`, or `None` when the product overflows `usize` (a shape from a file,
/// a flag or shape arithmetic must never wrap around to a small count).
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}
