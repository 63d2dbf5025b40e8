//! Where an input's values land in a slot: the engine input it names, or a host buffer after
//! the engine's inputs (a tokenized prompt's text, tokenized after the decode; a pi0.5 state
//! only the prompt reads, normalised into float32 as openpi discretises it). And the check
//! that every engine input is fed.

use crate::bind::tokens::{self, TokenBinding};
use crate::config::{ConfigError, InputConfig, PolicySpec, invalid};
use crate::dtype::ElemType;
use crate::engine::{IoSpec, TensorSpec, describe};

/// A slot's buffers past the engine's inputs, in the order they are added.
pub(super) struct HostBuffers {
    engine_inputs: usize,
    sizes: Vec<usize>,
}

impl HostBuffers {
    pub(super) fn new(io: &IoSpec) -> HostBuffers {
        HostBuffers {
            engine_inputs: io.inputs.len(),
            sizes: Vec::new(),
        }
    }

    /// A new buffer of `bytes`: its index among a slot's input buffers.
    pub(super) fn add(&mut self, bytes: usize) -> usize {
        self.sizes.push(bytes);
        self.engine_inputs + self.sizes.len() - 1
    }

    pub(super) fn into_sizes(self) -> Vec<usize> {
        self.sizes
    }
}

/// Where binding `i` lands: the buffer's index, the spec it is checked against, and for a
/// tokenized prompt where its ids and mask go.
pub(super) struct Slot {
    pub(super) index: usize,
    pub(super) spec: TensorSpec,
    pub(super) tokens: Option<TokenBinding>,
}

pub(super) fn resolve(
    i: usize,
    b: &InputConfig,
    policy: &PolicySpec,
    io: &IoSpec,
    host: &mut HostBuffers,
) -> Result<Slot, ConfigError> {
    let tensor_index = |name: &str| {
        io.inputs
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| {
                invalid(
                    format!("inputs[{i}].tensor"),
                    format!(
                        "the model has no input '{name}'; its inputs are: {}",
                        describe(&io.inputs)
                    ),
                )
            })
    };
    Ok(match (&b.tensor, b.tokenizer()) {
        (Some(name), Some(t)) => {
            let ids = tensor_index(name)?;
            let states = t
                .state_keys
                .iter()
                .filter_map(|key| policy.inputs.iter().position(|s| &s.key == key))
                .collect();
            let tb = tokens::compile(i, t, &io.inputs, ids, states)?;
            let bytes = tb.prompt_bytes;
            Slot {
                index: host.add(bytes),
                spec: TensorSpec {
                    name: format!("{} (prompt text)", b.key),
                    dtype: ElemType::U8,
                    shape: vec![bytes],
                },
                tokens: Some(tb),
            }
        }
        (Some(name), None) => {
            let index = tensor_index(name)?;
            Slot {
                index,
                spec: io.inputs[index].clone(),
                tokens: None,
            }
        }
        (None, _) => Slot {
            index: host.add(b.shape.iter().product::<usize>() * 4),
            spec: TensorSpec {
                name: format!("{} (prompt state)", b.key),
                dtype: ElemType::F32,
                shape: b.shape.clone(),
            },
            tokens: None,
        },
    })
}

/// Every engine input is fed by a binding: its tensor, a prompt's mask, or a presence flag.
pub(super) fn check_every_input_bound(policy: &PolicySpec, io: &IoSpec) -> Result<(), ConfigError> {
    for spec in &io.inputs {
        let bound = policy.inputs.iter().any(|b| {
            b.tensor.as_deref() == Some(spec.name.as_str())
                || b.tokenizer().is_some_and(|t| t.mask_tensor == spec.name)
                || b.presence.present_tensor.as_deref() == Some(spec.name.as_str())
        });
        if !bound {
            return Err(invalid(
                "inputs",
                format!(
                    "model input '{}' {} {:?} has no [[inputs]] binding; every model input needs \
                     one",
                    spec.name, spec.dtype, spec.shape
                ),
            ));
        }
    }
    Ok(())
}
