//! How the file becomes a [`Config`]: the `[[policies]]` list, and each policy's sections
//! checked in turn, every error naming its key through the section's [`Keys`].

use std::path::Path;

use super::access::{auth, tls};
use super::bindings::{RawInput, RawOutput, inputs, outputs};
use super::engine::{RawEngine, engine};
use super::lerobot::lerobot;
use super::pacing::{PacingConfig, pacing};
use super::pipeline::{RawDenoise, RawSampler, pipeline};
use super::planner::planner;
use super::raw::RawConfig;
use super::rtc::{RawRtc, rtc};
use super::server::server;
use super::{Config, ConfigError, Keys, PolicySpec, check_metadata, invalid};
use crate::limits::{MAX_POLICIES, MAX_POLICY_NAME};

/// Checks and resolves a parsed file; `base` is its folder (paths are relative to it).
pub(super) fn resolve(raw: RawConfig, base: Option<&Path>) -> Result<Config, ConfigError> {
    let top = Keys::top();
    let server = server(&raw.server)?;
    let named = !raw.policies.is_empty();
    let mut policies = Vec::new();
    let default;
    if named {
        policy_list(&raw)?;
        default = raw.policies.iter().position(|p| p.default).unwrap_or(0);
        for (i, p) in raw.policies.iter().enumerate() {
            let cx = Keys::policy(i, &p.name);
            let (mut pacing, pacing_keys) = match &p.pacing {
                Some(own) => (own.clone(), Keys::policy(i, &p.name)),
                None => (raw.pacing.clone(), Keys::top()),
            };
            if let Some(n) = p.actions_per_chunk {
                pacing.actions_per_chunk = n;
            }
            policies.push(policy(
                &cx,
                &pacing_keys,
                PolicyParts {
                    name: p.name.clone(),
                    is_default: i == default,
                    engine: &p.engine,
                    inputs: &p.inputs,
                    outputs: &p.outputs,
                    metadata: &p.metadata,
                    pacing,
                    reset_on_prompt_change: p.reset_on_prompt_change,
                    denoise: p.denoise.as_ref(),
                    sampler: p.sampler.as_ref(),
                    rtc: p.rtc.as_ref(),
                },
                base,
            )?);
        }
    } else {
        default = 0;
        policies.push(policy(
            &top,
            &top,
            PolicyParts {
                name: "default".into(),
                is_default: true,
                engine: &raw.engine,
                inputs: &raw.inputs,
                outputs: &raw.outputs,
                metadata: &raw.metadata,
                pacing: raw.pacing.clone(),
                reset_on_prompt_change: raw.reset_on_prompt_change,
                denoise: raw.denoise.as_ref(),
                sampler: raw.sampler.as_ref(),
                rtc: raw.rtc.as_ref(),
            },
            base,
        )?);
    }
    let lerobot = raw
        .lerobot
        .as_ref()
        .map(|l| lerobot(l, &policies, default))
        .transpose()?;
    Ok(Config {
        server,
        lerobot,
        planner: planner(&raw.planner, base)?,
        auth: auth(&raw.auth, base),
        tls: tls(&raw.tls, base)?,
        policies,
        default,
        named,
    })
}

/// `[[policies]]` as a list: names, the default, and nothing left at the top level.
pub(super) fn policy_list(raw: &RawConfig) -> Result<(), ConfigError> {
    if raw.policies.len() > MAX_POLICIES {
        return Err(invalid(
            "policies",
            format!(
                "{} policies declared; at most {MAX_POLICIES}",
                raw.policies.len()
            ),
        ));
    }
    for (i, p) in raw.policies.iter().enumerate() {
        let ok = !p.name.is_empty()
            && p.name.len() <= MAX_POLICY_NAME
            && p.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(invalid(
                format!("policies[{i}].name"),
                format!(
                    "\"{}\": use 1-{MAX_POLICY_NAME} letters, digits, '-', '_' or '.' (it \
                         goes in the path /policies/<name>)",
                    p.name
                ),
            ));
        }
        if let Some(j) = raw.policies[..i].iter().position(|q| q.name == p.name) {
            return Err(invalid(
                format!("policies[{i}].name"),
                format!("\"{}\" is also the name of policies[{j}]", p.name),
            ));
        }
    }
    let defaults: Vec<&str> = raw
        .policies
        .iter()
        .filter(|p| p.default)
        .map(|p| p.name.as_str())
        .collect();
    if defaults.len() > 1 {
        return Err(invalid(
            "policies.default",
            format!(
                "only one policy may be the default; {} are",
                defaults.join(", ")
            ),
        ));
    }
    for (key, set) in [
        ("engine", raw.engine.model.is_some()),
        ("inputs", !raw.inputs.is_empty()),
        ("outputs", !raw.outputs.is_empty()),
        ("metadata", !raw.metadata.is_empty()),
        ("reset_on_prompt_change", raw.reset_on_prompt_change),
        ("denoise", raw.denoise.is_some()),
        ("sampler", raw.sampler.is_some()),
        ("rtc", raw.rtc.is_some()),
    ] {
        if set {
            return Err(invalid(
                key,
                "with [[policies]], give it inside each policy ([policies.engine], \
                     [[policies.inputs]], [[policies.outputs]], [policies.metadata], \
                     reset_on_prompt_change)",
            ));
        }
    }
    Ok(())
}

/// What one policy is made of, from the top level or a `[[policies]]` entry.
pub(super) struct PolicyParts<'a> {
    name: String,
    is_default: bool,
    engine: &'a RawEngine,
    inputs: &'a [RawInput],
    outputs: &'a [RawOutput],
    metadata: &'a toml::Table,
    pacing: PacingConfig,
    reset_on_prompt_change: bool,
    denoise: Option<&'a RawDenoise>,
    sampler: Option<&'a RawSampler>,
    rtc: Option<&'a RawRtc>,
}

/// One policy's engine, pacing, bindings and metadata.
pub(super) fn policy(
    cx: &Keys,
    pacing_keys: &Keys,
    p: PolicyParts<'_>,
    base: Option<&Path>,
) -> Result<PolicySpec, ConfigError> {
    let (engine, model) = engine(cx, p.engine, base)?;
    let inputs = inputs(cx, p.inputs, base)?;
    pacing(pacing_keys, &p.pacing, &inputs)?;
    let outputs = outputs(cx, p.outputs)?;
    for (key, v) in p.metadata {
        check_metadata(cx, &format!("metadata.{key}"), v)?;
    }
    let mut pipeline = pipeline(cx, p.denoise, p.sampler, base)?;
    let rtc = rtc(cx, p.rtc, pipeline.as_ref())?;
    if rtc.is_some()
        && let Some(i) = outputs.iter().position(|o| o.relative.is_some())
    {
        return Err(cx.invalid(
            format!("outputs[{i}].relative_to"),
            "relative actions with [rtc]: the leftover is tied to the old observation's state \
             (LeRobot re-anchors it, and turns GR00T's RTC off for them); policyd does neither \
             yet, so turn one of them off",
        ));
    }
    if let Some(pl) = pipeline.as_mut()
        && rtc.is_some()
        && let Some(i) = outputs
            .iter()
            .position(|o| o.tensor == pl.x && o.rows.is_some_and(|(start, _)| start > 0))
    {
        return Err(cx.invalid(
            format!("outputs[{i}].rows"),
            "with [rtc] the chunk sent must start at the sample's first row: a new chunk's \
             first action is the observation's timestep, and the leftover is aligned to it",
        ));
    }
    if let Some(pl) = pipeline.as_mut() {
        pl.rtc = rtc;
    }
    Ok(PolicySpec {
        name: p.name,
        is_default: p.is_default,
        engine,
        model,
        inputs,
        outputs,
        metadata: p.metadata.clone(),
        pacing: p.pacing,
        reset_on_prompt_change: p.reset_on_prompt_change,
        pipeline,
    })
}
