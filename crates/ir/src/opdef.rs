//! Typed definitions of the ops npuc adds to ONNX (domain `npuc`): named inputs (optional ones
//! marked), outputs, attributes and a shape/dtype inference rule, in one [`OpDef`] that lives
//! next to the op's kernel. A definition serves three readers:
//!
//! - passes and graph builders construct nodes through [`OpDef::node`] (inputs by name, never a
//!   hand-counted positional list; [`NodeBuilder::build`] checks the contract);
//! - [`crate::infer`] looks the op up here ([`lookup`]) and runs its rule, so graphs with `npuc`
//!   ops get static shapes without running;
//! - [`OpDef::check`] validates a node against the contract (a verifier's op check).
//!
//! The crate that owns the kernel makes its definitions known with [`register`] (the runtime
//! does so for its own ops when its kernel registry is built; an op pack does so when it is
//! registered). This crate does no I/O and knows no kernels.

use crate::graph::{Attr, Node, TypeInfo};
use crate::infer::{NodeIn, R};
use crate::IrError;
use std::sync::RwLock;

/// One input or output of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    pub name: &'static str,
    /// May be omitted (an empty name, or absent at the end of the list).
    pub optional: bool,
}

impl Param {
    pub const fn required(name: &'static str) -> Param {
        Param {
            name,
            optional: false,
        }
    }
    pub const fn optional(name: &'static str) -> Param {
        Param {
            name,
            optional: true,
        }
    }
}

/// One attribute of an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttrDef {
    pub name: &'static str,
    /// The attribute's kind as [`Attr::kind`] spells it ("int", "float", "string", ...).
    pub kind: &'static str,
    pub required: bool,
}

impl AttrDef {
    pub const fn required(name: &'static str, kind: &'static str) -> AttrDef {
        AttrDef {
            name,
            kind,
            required: true,
        }
    }
    pub const fn optional(name: &'static str, kind: &'static str) -> AttrDef {
        AttrDef {
            name,
            kind,
            required: false,
        }
    }
}

/// An inference rule: the output types of a node from its inputs' types, known values and
/// attributes ([`NodeIn`]); an `Err` becomes a problem naming the node.
pub type InferFn = fn(&NodeIn) -> R<Vec<TypeInfo>>;

/// The definition of one op.
#[derive(Debug)]
pub struct OpDef {
    pub domain: &'static str,
    pub name: &'static str,
    pub inputs: &'static [Param],
    pub outputs: &'static [Param],
    pub attrs: &'static [AttrDef],
    pub infer: InferFn,
}

impl OpDef {
    /// Starts a node of this op; see [`NodeBuilder`].
    pub fn node(&'static self, name: impl Into<String>) -> NodeBuilder {
        NodeBuilder {
            def: self,
            name: name.into(),
            inputs: vec![String::new(); self.inputs.len()],
            outputs: vec![String::new(); self.outputs.len()],
            attrs: vec![],
            unknown: vec![],
        }
    }

    /// Position of input `name`.
    pub fn input_index(&self, name: &str) -> Option<usize> {
        self.inputs.iter().position(|p| p.name == name)
    }

    /// Checks `n` against the contract: not more inputs/outputs than defined, every required
    /// input and output given, every required attribute present, attributes of the defined
    /// kinds. Attributes the definition does not list are allowed (carried metadata).
    pub fn check(&self, n: &Node) -> Result<(), IrError> {
        let qualified = format!("{}.{}", self.domain, self.name);
        for (what, params, given) in [
            ("input", self.inputs, &n.inputs),
            ("output", self.outputs, &n.outputs),
        ] {
            if given.len() > params.len() {
                return Err(n.error(format!(
                    "{qualified} takes at most {} {what}s, found {}",
                    params.len(),
                    given.len()
                )));
            }
            for (i, p) in params.iter().enumerate() {
                let present = given.get(i).is_some_and(|s| !s.is_empty());
                if !p.optional && !present {
                    return Err(n.error(format!(
                        "{qualified}: required {what} {i} ('{}') is missing",
                        p.name
                    )));
                }
            }
        }
        for a in self.attrs {
            match n.attr(a.name) {
                None if a.required => {
                    return Err(n.error(format!(
                        "{qualified}: required attribute '{}' is missing",
                        a.name
                    )))
                }
                Some(v) if v.kind() != a.kind => {
                    return Err(n.error(format!(
                        "{qualified}: attribute '{}' should be {}, found {}",
                        a.name,
                        a.kind,
                        v.kind()
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Builds a node of an [`OpDef`] with inputs and outputs given by name.
#[derive(Debug)]
pub struct NodeBuilder {
    def: &'static OpDef,
    name: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    attrs: Vec<(String, Attr)>,
    /// Names given that the definition does not have (reported by `build`).
    unknown: Vec<String>,
}

impl NodeBuilder {
    /// Sets input `param` to value `value`.
    pub fn input(mut self, param: &str, value: impl Into<String>) -> NodeBuilder {
        match self.def.input_index(param) {
            Some(i) => self.inputs[i] = value.into(),
            None => self.unknown.push(format!("input '{param}'")),
        }
        self
    }
    /// Sets an optional input when `value` is `Some` and not empty.
    pub fn opt_input(self, param: &str, value: Option<impl Into<String>>) -> NodeBuilder {
        match value {
            Some(v) => self.input(param, v),
            None => self,
        }
    }
    /// Sets output `param` to value `value`.
    pub fn output(mut self, param: &str, value: impl Into<String>) -> NodeBuilder {
        match self.def.outputs.iter().position(|p| p.name == param) {
            Some(i) => self.outputs[i] = value.into(),
            None => self.unknown.push(format!("output '{param}'")),
        }
        self
    }
    pub fn attr(mut self, name: &str, value: Attr) -> NodeBuilder {
        self.attrs.retain(|(n, _)| n != name);
        self.attrs.push((name.to_string(), value));
        self
    }
    /// The node, with omitted trailing optional inputs/outputs dropped; an error names the op
    /// and what does not fit its definition.
    pub fn build(self) -> Result<Node, IrError> {
        let def = self.def;
        let trim = |mut v: Vec<String>| {
            while v.last().is_some_and(|s| s.is_empty()) {
                v.pop();
            }
            v
        };
        let node = Node {
            name: self.name,
            op_type: def.name.to_string(),
            domain: def.domain.to_string(),
            inputs: trim(self.inputs),
            outputs: trim(self.outputs),
            attrs: self.attrs,
            doc: String::new(),
        };
        if let Some(u) = self.unknown.first() {
            return Err(node.error(format!("{}.{} has no {u}", def.domain, def.name)));
        }
        def.check(&node)?;
        Ok(node)
    }
}

/// Definitions made known by [`register`].
static TABLE: RwLock<Vec<&'static OpDef>> = RwLock::new(Vec::new());

/// Makes definitions known to [`lookup`] (and so to inference); one already known (same domain
/// and name) is kept.
pub fn register(defs: &[&'static OpDef]) {
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    for d in defs {
        if !t.iter().any(|k| k.domain == d.domain && k.name == d.name) {
            t.push(d);
        }
    }
}

/// The definition of op `name` of `domain`, when one was registered.
pub fn lookup(domain: &str, name: &str) -> Option<&'static OpDef> {
    let domain = crate::graph::normalize_domain(domain);
    TABLE
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|d| d.domain == domain && d.name == name)
        .copied()
}

/// Every registered definition, in registration order.
pub fn all() -> Vec<&'static OpDef> {
    TABLE.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The op contracts of every registered definition: a node whose op has an [`OpDef`] must
/// satisfy [`OpDef::check`]; ops without one (ONNX ops, checked by inference) pass. This is
/// what the pass manager's between-pass verifier applies by default.
pub struct RegisteredOps;

impl crate::verify::OpContracts for RegisteredOps {
    fn check(&self, node: &Node, _types: &crate::infer::InferResult) -> Result<(), String> {
        match lookup(&node.domain, &node.op_type) {
            Some(def) => def.check(node).map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same_as_first(n: &NodeIn) -> R<Vec<TypeInfo>> {
        Ok(vec![n.ty(0).cloned().unwrap_or(TypeInfo::Tensor {
            dtype: None,
            shape: None,
        })])
    }

    static TEST_OP: OpDef = OpDef {
        domain: "test",
        name: "Op",
        inputs: &[
            Param::required("x"),
            Param::optional("mid"),
            Param::optional("last"),
        ],
        outputs: &[Param::required("y")],
        attrs: &[AttrDef::required("k", "int")],
        infer: same_as_first,
    };

    #[test]
    fn builder_places_inputs_by_name_and_checks_the_contract() {
        let n = TEST_OP
            .node("n")
            .input("x", "a")
            .input("last", "c")
            .output("y", "out")
            .attr("k", Attr::Int(3))
            .build()
            .unwrap();
        assert_eq!(n.inputs, ["a", "", "c"]);
        assert_eq!(n.domain, "test");
        let n = TEST_OP
            .node("n")
            .input("x", "a")
            .output("y", "out")
            .attr("k", Attr::Int(3))
            .build()
            .unwrap();
        assert_eq!(n.inputs, ["a"], "trailing omitted inputs are dropped");
        let e = TEST_OP
            .node("n")
            .input("z", "a")
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("test.Op has no input 'z'"), "{e}");
        let e = TEST_OP
            .node("n")
            .input("x", "a")
            .output("y", "o")
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("required attribute 'k' is missing"), "{e}");
        let e = TEST_OP
            .node("n")
            .output("y", "o")
            .attr("k", Attr::Float(1.0))
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("required input 0 ('x') is missing"), "{e}");
    }

    #[test]
    fn lookup_finds_registered_definitions() {
        register(&[&TEST_OP]);
        register(&[&TEST_OP]);
        assert!(lookup("test", "Op").is_some());
        assert_eq!(all().iter().filter(|d| d.name == "Op").count(), 1);
        assert!(lookup("test", "Other").is_none());
    }
}
