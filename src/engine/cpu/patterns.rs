//! Which graph patterns does tract 0.23 fail on (or run slowly), and which rewrite fixes each?
//!
//! The CPU engine scans a graph's nodes when it loads it, so that a failure tract reports in its
//! own terms (`TDim is not a number`, `Trying to substitute …`) comes with the pattern behind it
//! and the rewrite that removes it: `policyd-export rewrite IN.onnx OUT.onnx` (docs/export.md,
//! "tract: the rewrites"). tract still tries every graph, so a tract release that fixes a bug
//! serves the graph unchanged.

use std::collections::{HashMap, HashSet};

use tract_onnx::pb::{GraphProto, NodeProto, tensor_proto::DataType};
use tract_onnx::prelude::Framework;

use crate::config::ModelSource;

/// How many of each known pattern a graph has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// R1: `CumSum` over `Cast(to=INT64)` (tract fails to evaluate it).
    pub cumsum_int64: usize,
    /// R2: `MatMul(Concat(…, Expand(…), …), constant)` (tract's declutter loses the broadcast).
    pub concat_expand_matmul: usize,
    /// R3: `Pow(x, 3)` (correct, but libm's powf: slow).
    pub pow3: usize,
}

const REWRITE: &str = "rewrite the graph with `policyd-export rewrite IN.onnx OUT.onnx` (an \
                       identity in exact arithmetic, checked in onnxruntime; docs/export.md)";

impl Findings {
    /// The explanation to attach to a failure, when the graph has a pattern tract 0.23 fails on.
    pub fn failing(&self) -> Option<String> {
        let mut found = Vec::new();
        if self.cumsum_int64 > 0 {
            found.push(format!(
                "{} CumSum over Cast(to=INT64) (R1: tract casts to its symbolic TDim, which \
                 CumSum cannot evaluate)",
                self.cumsum_int64
            ));
        }
        if self.concat_expand_matmul > 0 {
            found.push(format!(
                "{} MatMul over a Concat holding an Expand (R2: tract's declutter drops the \
                 broadcast)",
                self.concat_expand_matmul
            ));
        }
        (!found.is_empty()).then(|| {
            format!(
                "this graph has {}, which tract 0.23 cannot run: {REWRITE}",
                found.join(" and ")
            )
        })
    }

    /// A note for a graph that runs but slowly (logged at load).
    pub fn slow(&self) -> Option<String> {
        (self.pow3 > 0).then(|| {
            format!(
                "this graph has {} Pow(x, 3), which tract computes with libm's powf, about 14x \
                 slower than x·x·x (R3): {REWRITE}",
                self.pow3
            )
        })
    }
}

fn int_attr(node: &NodeProto, name: &str) -> Option<i64> {
    node.attribute.iter().find(|a| a.name == name).map(|a| a.i)
}

/// Scans a model's graph; `None` when it cannot be parsed (tract's own load then says why).
pub fn scan_model(model: &ModelSource) -> Option<Findings> {
    let onnx = tract_onnx::onnx();
    let proto = match model {
        ModelSource::File(path) => onnx.proto_model_for_path(path).ok()?,
        ModelSource::Embedded { bytes, .. } => {
            let mut reader: &[u8] = bytes;
            onnx.proto_model_for_read(&mut reader).ok()?
        }
    };
    proto.graph.as_ref().map(scan)
}

/// Scans the main graph's nodes (not subgraphs) for the three patterns.
pub fn scan(graph: &GraphProto) -> Findings {
    let producer: HashMap<&str, &NodeProto> = graph
        .node
        .iter()
        .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
        .collect();
    let constants: HashSet<&str> = graph
        .initializer
        .iter()
        .map(|t| t.name.as_str())
        .chain(
            graph
                .node
                .iter()
                .filter(|n| n.op_type == "Constant")
                .flat_map(|n| n.output.iter().map(String::as_str)),
        )
        .collect();
    let made_by = |name: &str, op: &str| producer.get(name).filter(|n| n.op_type == op).copied();
    let mut f = Findings::default();
    for node in &graph.node {
        let input = |i: usize| node.input.get(i).map(String::as_str).unwrap_or("");
        match node.op_type.as_str() {
            "CumSum"
                if made_by(input(0), "Cast")
                    .is_some_and(|c| int_attr(c, "to") == Some(DataType::Int64 as i64)) =>
            {
                f.cumsum_int64 += 1;
            }
            "MatMul"
                if constants.contains(input(1))
                    && made_by(input(0), "Concat").is_some_and(|c| {
                        c.input.iter().any(|p| made_by(p, "Expand").is_some())
                    }) =>
            {
                f.concat_expand_matmul += 1;
            }
            "Pow" if scalar_three(graph, &producer, input(1)) => f.pow3 += 1,
            _ => {}
        }
    }
    f
}

/// Whether `name` is a constant scalar 3 (an initializer or a `Constant` node), as float or int.
fn scalar_three(graph: &GraphProto, producer: &HashMap<&str, &NodeProto>, name: &str) -> bool {
    let tensor = graph
        .initializer
        .iter()
        .find(|t| t.name == name)
        .or_else(|| {
            producer
                .get(name)
                .filter(|n| n.op_type == "Constant")
                .and_then(|n| n.attribute.iter().find(|a| a.name == "value"))
                .and_then(|a| a.t.as_ref())
        });
    let Some(t) = tensor else {
        return false;
    };
    if t.dims.iter().product::<i64>() != 1 {
        return false;
    }
    let raw = &t.raw_data;
    let value = match DataType::try_from(t.data_type).ok() {
        Some(DataType::Float) => t.float_data.first().map(|v| f64::from(*v)).or_else(|| {
            raw.get(..4)
                .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        }),
        Some(DataType::Double) => t.double_data.first().copied().or_else(|| {
            raw.get(..8)
                .and_then(|b| b.try_into().ok())
                .map(f64::from_le_bytes)
        }),
        Some(DataType::Int64) => t.int64_data.first().map(|v| *v as f64).or_else(|| {
            raw.get(..8)
                .and_then(|b| b.try_into().ok())
                .map(|b| i64::from_le_bytes(b) as f64)
        }),
        _ => None,
    };
    value == Some(3.0)
}
