//! RegexFullMatch (opset 20) over the `regex` crate (RE2 syntax, linear time).

use npuc_ir::Tensor;
use npuc_runtime::{bail, Inputs, OpCtx, Registry, Result, Value};

pub fn register(r: &mut Registry) {
    r.add("RegexFullMatch", 20, regex_full_match);
}

/// RegexFullMatch: true where the whole string matches `pattern` (RE2 syntax).
fn regex_full_match(ctx: &OpCtx, ins: Inputs) -> Result<Vec<Value>> {
    let x = ins.tensor(0)?;
    let pattern = ctx.node.str_or("pattern", "")?;
    let re = match regex::Regex::new(&format!("^(?:{pattern})$")) {
        Ok(r) => r,
        Err(e) => bail!("invalid regex pattern {pattern:?}: {e}"),
    };
    let out: Vec<bool> = x.as_strings()?.iter().map(|s| re.is_match(s)).collect();
    Ok(vec![Value::tensor(Tensor::from_vec(
        x.shape().to_vec(),
        out,
    )?)])
}
