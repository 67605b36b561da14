//! `Tensor::into_shared`: clones share one buffer, values and dtype are unchanged, writes copy.

use half::f16;
use npuc_ir::{DType, Tensor};

#[test]
fn shared_clones_share_one_buffer() {
    let v: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
    let t = Tensor::from_vec(vec![10, 100], v.clone())
        .unwrap()
        .into_shared();
    assert!(t.is_borrowed());
    assert_eq!(t.dtype(), DType::F32);
    assert_eq!(t.shape(), &[10, 100]);
    let c = t.clone();
    let (a, b) = (t.as_slice::<f32>().unwrap(), c.as_slice::<f32>().unwrap());
    assert_eq!(a, v.as_slice());
    assert_eq!(a.as_ptr(), b.as_ptr(), "a clone copied the values");
    // A write goes to a private copy; the other clone keeps the original values.
    let mut w = c.clone();
    w.as_mut_slice::<f32>().unwrap()[0] = 42.0;
    assert_eq!(w.as_slice::<f32>().unwrap()[0], 42.0);
    assert_eq!(t.as_slice::<f32>().unwrap()[0], v[0]);
}

#[test]
fn shared_keeps_every_numeric_dtype() {
    let h = Tensor::from_vec(vec![3], vec![f16::from_f32(1.5), f16::ZERO, f16::MAX])
        .unwrap()
        .into_shared();
    assert_eq!(h.dtype(), DType::F16);
    assert_eq!(
        h.as_slice::<f16>().unwrap(),
        &[f16::from_f32(1.5), f16::ZERO, f16::MAX]
    );
    let q = Tensor::from_vec(vec![2, 2], vec![-128i8, 127, 0, -1])
        .unwrap()
        .into_shared();
    assert_eq!(q.as_slice::<i8>().unwrap(), &[-128, 127, 0, -1]);
    let i = Tensor::from_vec(vec![2], vec![i64::MIN, i64::MAX])
        .unwrap()
        .into_shared();
    assert_eq!(i.as_slice::<i64>().unwrap(), &[i64::MIN, i64::MAX]);
}

#[test]
fn shared_leaves_sub_byte_and_strings_owned() {
    let q4 = Tensor::from_codes(DType::I4, vec![4], vec![1, 15, 7, 8])
        .unwrap()
        .into_shared();
    assert!(!q4.is_borrowed());
    assert_eq!(q4.dtype(), DType::I4);
    assert_eq!(q4.as_slice::<i8>().unwrap(), &[1, -1, 7, -8]);
    let s = Tensor::from_strings(vec![1], vec!["a".into()])
        .unwrap()
        .into_shared();
    assert!(!s.is_borrowed());
    let b = Tensor::from_vec(vec![2], vec![true, false])
        .unwrap()
        .into_shared();
    assert!(!b.is_borrowed());
}
