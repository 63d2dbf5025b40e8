//! What does `policyd` with no arguments serve? The embedded default: the ALOHA demo policy and its
//! config, built into the binary, so that `policyd` with no arguments serves something real on the
//! CPU engine; or, in a firmware image, the integrator's config and every model it names, baked in
//! at build time (`POLICYD_EMBED_CONFIG`, read by build.rs).

use crate::config::{Config, ConfigError, ModelSource, invalid};

/// A config baked into the binary at build time, with its models.
#[derive(Clone, Copy, Debug)]
pub struct Baked {
    /// `POLICYD_EMBED_CONFIG` as given to the build.
    pub source: &'static str,
    pub config: &'static str,
    pub models: &'static [BakedModel],
}

/// One `engine.model` (or tokenizer file) of a baked config: the path as the config writes it,
/// and its bytes.
#[derive(Clone, Copy, Debug)]
pub struct BakedModel {
    pub path: &'static str,
    pub name: &'static str,
    pub bytes: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/baked.rs"));

/// The embedded config (the same text as `configs/aloha.toml`).
pub const CONFIG: &str = include_str!("../configs/aloha.toml");
/// The embedded model (`models/aloha.onnx`).
pub const MODEL: &[u8] = include_bytes!("../models/aloha.onnx");

/// The config text `policyd` serves with no arguments (`print-default-config`).
pub fn config_text() -> &'static str {
    BAKED.map_or(CONFIG, |b| b.config)
}

/// What `policyd` serves with no arguments: the baked config if this binary has one, else the
/// demo; with every model built in.
pub fn config() -> Result<Config, ConfigError> {
    match BAKED {
        Some(b) => baked(&b),
        None => demo(),
    }
}

fn baked(b: &Baked) -> Result<Config, ConfigError> {
    let mut cfg = Config::parse(b.config, &format!("<built-in {}>", b.source), None)?;
    for p in &mut cfg.policies {
        let ModelSource::File(path) = &p.model else {
            continue;
        };
        let Some(m) = b.models.iter().find(|m| path.as_os_str() == m.path) else {
            return Err(invalid(
                "engine.model",
                format!("{} was not built into this binary", path.display()),
            ));
        };
        p.model = ModelSource::Embedded {
            name: m.name,
            bytes: m.bytes,
            data: external(b, m.path),
        };
        if let Some(pipeline) = &mut p.pipeline
            && let ModelSource::File(path) = &pipeline.denoise
        {
            let Some(m) = b.models.iter().find(|m| path.as_os_str() == m.path) else {
                return Err(invalid(
                    "denoise.model",
                    format!("{} was not built into this binary", path.display()),
                ));
            };
            pipeline.denoise = ModelSource::Embedded {
                name: m.name,
                bytes: m.bytes,
                data: external(b, m.path),
            };
        }
        for (i, input) in p.inputs.iter_mut().enumerate() {
            let crate::config::InputKind::Tokens(t) = &mut input.kind else {
                continue;
            };
            let ModelSource::File(path) = &t.file else {
                continue;
            };
            let Some(m) = b.models.iter().find(|m| path.as_os_str() == m.path) else {
                return Err(invalid(
                    format!("inputs[{i}].tokenizer.file"),
                    format!("{} was not built into this binary", path.display()),
                ));
            };
            t.file = ModelSource::Embedded {
                name: m.name,
                bytes: m.bytes,
                data: &[],
            };
        }
    }
    Ok(cfg)
}

/// The external data baked beside the model written as `path` (`<path>.data`), if any.
fn external(b: &Baked, path: &str) -> &'static [u8] {
    let data = format!("{path}.data");
    b.models
        .iter()
        .find(|m| m.path == data)
        .map_or(&[], |m| m.bytes)
}

fn demo() -> Result<Config, ConfigError> {
    let mut cfg = Config::parse(CONFIG, "<embedded configs/aloha.toml>", None)?;
    for p in &mut cfg.policies {
        p.model = ModelSource::Embedded {
            name: "aloha.onnx",
            bytes: MODEL,
            data: &[],
        };
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A firmware image of configs/prompted.toml: its model and tokenizer are served from the
    /// binary, and a tokenizer file the build did not bake is refused by its key.
    #[test]
    fn a_baked_config_serves_its_tokenizer_from_the_binary() {
        const MODEL: &[u8] = include_bytes!("../models/prompted.onnx");
        const TOKENIZER: &[u8] = include_bytes!("../models/tokenizer/bpe.model");
        let models = [
            BakedModel {
                path: "../models/prompted.onnx",
                name: "prompted.onnx",
                bytes: MODEL,
            },
            BakedModel {
                path: "../models/tokenizer/bpe.model",
                name: "bpe.model",
                bytes: TOKENIZER,
            },
        ];
        let models: &'static [BakedModel] = Box::leak(Box::new(models));
        let b = Baked {
            source: "configs/prompted.toml",
            config: include_str!("../configs/prompted.toml"),
            models,
        };
        let cfg = baked(&b).expect("the baked config resolves");
        let t = cfg.default_policy().inputs[1]
            .tokenizer()
            .expect("a tokenized prompt");
        assert_eq!(
            t.file,
            ModelSource::Embedded {
                name: "bpe.model",
                bytes: TOKENIZER,
                data: &[],
            }
        );
        let partial = Baked {
            models: &models[..1],
            ..b
        };
        let e = baked(&partial).unwrap_err().to_string();
        assert!(
            e.contains("inputs[1].tokenizer.file") && e.contains("not built into"),
            "{e}"
        );
    }

    /// A firmware image of a pipeline (configs/diffusion.toml, what a Diffusion Policy bundle
    /// looks like): the step graph is served from the binary too.
    #[test]
    fn a_baked_pipeline_serves_its_step_graph_from_the_binary() {
        const ENCODER: &[u8] = include_bytes!("../models/diffusion_encoder.onnx");
        const UNET: &[u8] = include_bytes!("../models/diffusion_unet.onnx");
        let models = [
            BakedModel {
                path: "../models/diffusion_encoder.onnx",
                name: "diffusion_encoder.onnx",
                bytes: ENCODER,
            },
            BakedModel {
                path: "../models/diffusion_unet.onnx",
                name: "diffusion_unet.onnx",
                bytes: UNET,
            },
        ];
        let models: &'static [BakedModel] = Box::leak(Box::new(models));
        let b = Baked {
            source: "configs/diffusion.toml",
            config: include_str!("../configs/diffusion.toml"),
            models,
        };
        let cfg = baked(&b).expect("the baked config resolves");
        let pipeline = cfg.default_policy().pipeline.as_ref().expect("a pipeline");
        assert_eq!(
            pipeline.denoise,
            ModelSource::Embedded {
                name: "diffusion_unet.onnx",
                bytes: UNET,
                data: &[],
            }
        );
        let partial = Baked {
            models: &models[..1],
            ..b
        };
        let e = baked(&partial).unwrap_err().to_string();
        assert!(
            e.contains("denoise.model") && e.contains("not built into"),
            "{e}"
        );
    }
}
