//! Shape products that come from a file or a flag never wrap around: a shape whose element
//! count overflows is an error naming the shape, not a small tensor.

use npuc_ir::{checked_numel, DType, IrError, Tensor};

/// 2^32 x 2^32 elements: the product is 2^64, which wraps to 0 in an unchecked `usize` product
/// (and would then "match" an empty buffer).
const WRAPS_TO_ZERO: [usize; 2] = [1 << 32, 1 << 32];

#[test]
fn checked_numel_detects_overflow() {
    assert_eq!(checked_numel(&[]), Some(1));
    assert_eq!(checked_numel(&[2, 3, 4]), Some(24));
    // A zero dimension makes the product 0 from there on: an empty tensor, not an overflow.
    assert_eq!(checked_numel(&[0, usize::MAX, 2]), Some(0));
    assert_eq!(checked_numel(&[usize::MAX, 2]), None);
    assert_eq!(checked_numel(&WRAPS_TO_ZERO), None);
}

#[test]
fn wrapping_shapes_are_rejected() {
    let e = Tensor::from_vec::<f32>(WRAPS_TO_ZERO.to_vec(), vec![]).unwrap_err();
    assert!(matches!(e, IrError::ShapeData { .. }), "{e}");
    assert!(e.to_string().contains("more than 2^64"), "{e}");
    let e = Tensor::from_le_bytes_copy(DType::F32, WRAPS_TO_ZERO.to_vec(), &[]).unwrap_err();
    assert!(matches!(e, IrError::ShapeOverflow { .. }), "{e}");
    // The byte count overflows even though the element count fits.
    let e = Tensor::from_le_bytes_copy(DType::F32, vec![1 << 62], &[]).unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
    let t = Tensor::from_vec::<f32>(vec![0], vec![]).unwrap();
    let e = t.reshaped(WRAPS_TO_ZERO.to_vec()).unwrap_err();
    assert!(matches!(e, IrError::ShapeData { .. }), "{e}");
}
