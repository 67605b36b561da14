//! `spill::spill_initializers`: in-memory weights move to a mapped temporary file with their
//! values, dtypes and shapes unchanged; small, sub-byte and already-mapped ones stay.

use npuc_ir::{DType, Graph, Initializer, Tensor};

fn init(name: &str, tensor: Tensor) -> Initializer {
    Initializer {
        name: name.into(),
        tensor,
    }
}

#[test]
fn in_memory_weights_move_to_a_mapped_file_unchanged() {
    let big: Vec<f32> = (0..300_000).map(|i| (i as f32).sin()).collect();
    let shared: Vec<i8> = (0..200_000).map(|i| (i % 251) as i8).collect();
    let halves: Vec<npuc_ir::f16> = (0..70_001)
        .map(|i| npuc_ir::f16::from_f32(i as f32 * 0.01))
        .collect();
    let mut g = Graph {
        initializers: vec![
            init(
                "big",
                Tensor::from_vec(vec![300, 1000], big.clone()).unwrap(),
            ),
            init(
                "small",
                Tensor::from_vec(vec![3], vec![1f32, 2., 3.]).unwrap(),
            ),
            init(
                "shared",
                Tensor::from_vec(vec![200_000], shared.clone())
                    .unwrap()
                    .into_shared(),
            ),
            // An odd byte length: the next window must still start aligned.
            init(
                "halves",
                Tensor::from_vec(vec![70_001], halves.clone()).unwrap(),
            ),
            init(
                "codes",
                Tensor::from_codes(DType::I4, vec![200_000], vec![3; 200_000]).unwrap(),
            ),
            init(
                "after",
                Tensor::from_vec(vec![100_000], big[..100_000].to_vec()).unwrap(),
            ),
        ],
        ..Default::default()
    };
    let moved = npuc_onnx::spill::spill_initializers(&mut g, None, 100_000).unwrap();
    assert_eq!(
        moved,
        300_000 * 4 + 200_000 + 70_001 * 2 + 100_000 * 4,
        "bytes moved"
    );
    let t = |n: &str| &g.initializers.iter().find(|i| i.name == n).unwrap().tensor;
    for n in ["big", "shared", "halves", "after"] {
        assert!(t(n).is_releasable(), "{n} was not moved");
    }
    for n in ["small", "codes"] {
        assert!(!t(n).is_releasable(), "{n} was moved");
    }
    assert_eq!(t("big").shape(), &[300, 1000]);
    assert_eq!(t("big").as_slice::<f32>().unwrap(), big.as_slice());
    assert_eq!(t("shared").as_slice::<i8>().unwrap(), shared.as_slice());
    assert_eq!(t("halves").dtype(), DType::F16);
    assert_eq!(
        t("halves").as_slice::<npuc_ir::f16>().unwrap(),
        halves.as_slice()
    );
    assert_eq!(t("after").as_slice::<f32>().unwrap(), &big[..100_000]);
    assert_eq!(t("codes").as_slice::<i8>().unwrap()[0], 3);
    // Giving the pages back keeps the values (they come back from the file).
    t("big").release_resident();
    assert_eq!(t("big").as_slice::<f32>().unwrap(), big.as_slice());
    // A second spill finds nothing left to move.
    assert_eq!(
        npuc_onnx::spill::spill_initializers(&mut g, None, 100_000).unwrap(),
        0
    );
}
