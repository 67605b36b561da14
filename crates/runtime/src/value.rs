use npuc_ir::Tensor;
use std::sync::Arc;

/// A runtime value. Tensors are shared (`Arc`) so that fan-out costs nothing; a kernel that
/// owns the last reference can take the tensor and reuse its buffer.
#[derive(Clone, Debug)]
pub enum Value {
    Tensor(Arc<Tensor>),
    Sequence(Vec<Value>),
    Optional(Option<Box<Value>>),
}

impl Value {
    pub fn tensor(t: Tensor) -> Value {
        Value::Tensor(Arc::new(t))
    }
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Tensor(_) => "tensor",
            Value::Sequence(_) => "sequence",
            Value::Optional(_) => "optional",
        }
    }
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Value {
        Value::tensor(t)
    }
}
