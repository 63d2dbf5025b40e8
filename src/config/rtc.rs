//! `[rtc]`: real-time chunking, how a flow policy's new chunk continues the one the robot is
//! executing (LeRobot's `RTCConfig`, and GR00T N1.7's own keys).

use serde::Deserialize;

use super::{ConfigError, Keys, PipelineConfig};
use crate::rtc::{Method, Schedule, Settings};
use crate::sampler::{FlowTime, Kind};

/// `[rtc]`, as written. A bare table turns RTC on with LeRobot's defaults.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRtc {
    #[serde(default)]
    pub(super) enabled: Option<bool>,
    #[serde(default)]
    pub(super) execution_horizon: Option<usize>,
    #[serde(default)]
    pub(super) prefix_attention_schedule: Option<String>,
    #[serde(default)]
    pub(super) max_guidance_weight: Option<f64>,
    /// A fixed delay in control steps, instead of the session's measured one.
    #[serde(default)]
    pub(super) inference_delay: Option<usize>,
    /// GR00T N1.7 only: the velocity ramp over the leftover's rows after the delay.
    #[serde(default)]
    pub(super) rtc_ramp_rate: Option<f64>,
}

/// LeRobot's `RTCConfig` defaults.
const EXECUTION_HORIZON: usize = 10;
const MAX_GUIDANCE_WEIGHT: f64 = 10.0;
/// GR00T N1.7's `rtc_ramp_rate`.
const RAMP_RATE: f64 = 6.0;

/// `[rtc]` against the policy's pipeline: `None` when absent or `enabled = false`. Checked
/// here: the sampler can take it (a flow sampler that applies the update itself), each key's
/// value, and which keys the family has. The chunk's length is checked when the step graph is
/// loaded (`execution_horizon` must fit it).
pub(super) fn rtc(
    cx: &Keys,
    raw: Option<&RawRtc>,
    pipeline: Option<&PipelineConfig>,
) -> Result<Option<Settings>, ConfigError> {
    let Some(r) = raw else {
        return Ok(None);
    };
    let Some(p) = pipeline else {
        return Err(cx.invalid(
            "rtc",
            "real-time chunking guides a flow sampler's steps, and this policy has none \
             ([denoise] and [sampler] kind = \"flow\"): ACT is one network pass; remove [rtc]",
        ));
    };
    if p.kind != Kind::Flow {
        return Err(cx.invalid(
            "rtc",
            format!(
                "real-time chunking is for flow matching (pi0, pi0.5, SmolVLA, GR00T), not a \
                 {} sampler (Diffusion); remove [rtc]",
                if p.kind == Kind::Ddpm { "DDPM" } else { "DDIM" }
            ),
        ));
    }
    if p.model_update.is_some() {
        return Err(cx.invalid(
            "rtc",
            "needs the step graph's velocity, and sampler.update = \"model\" returns the next \
             sample instead; export the step graph with update = \"sampler\"",
        ));
    }
    if r.enabled == Some(false) {
        return Ok(None);
    }
    let horizon = r.execution_horizon.unwrap_or(EXECUTION_HORIZON);
    cx.between(
        "rtc.execution_horizon",
        horizon,
        1,
        crate::limits::MAX_ELEMENTS,
    )?;
    if let Some(d) = r.inference_delay {
        cx.between("rtc.inference_delay", d, 0, crate::limits::MAX_ELEMENTS)?;
    }
    let method = if p.flow_time == FlowTime::Groot {
        inpaint(cx, r)?
    } else {
        guidance(cx, r)?
    };
    Ok(Some(Settings {
        execution_horizon: horizon,
        inference_delay: r.inference_delay,
        method,
    }))
}

/// GR00T N1.7's keys: its ramp rate, and no schedule or guidance weight.
fn inpaint(cx: &Keys, r: &RawRtc) -> Result<Method, ConfigError> {
    for (key, set) in [
        (
            "rtc.prefix_attention_schedule",
            r.prefix_attention_schedule.is_some(),
        ),
        ("rtc.max_guidance_weight", r.max_guidance_weight.is_some()),
    ] {
        if set {
            return Err(cx.invalid(
                key,
                "GR00T N1.7's RTC inpaints the leftover into the noise (LeRobot maps it so), \
                 with no schedule or guidance weight; its key is rtc.rtc_ramp_rate",
            ));
        }
    }
    let k = r.rtc_ramp_rate.unwrap_or(RAMP_RATE);
    if !(k.is_finite() && k > 0.0) {
        return Err(cx.invalid(
            "rtc.rtc_ramp_rate",
            format!("must be a positive number, got {k}"),
        ));
    }
    Ok(Method::Inpaint {
        ramp_rate: k as f32,
    })
}

/// The guided flow families' keys: the schedule and the guidance weight, and no ramp rate.
fn guidance(cx: &Keys, r: &RawRtc) -> Result<Method, ConfigError> {
    if r.rtc_ramp_rate.is_some() {
        return Err(cx.invalid(
            "rtc.rtc_ramp_rate",
            "is GR00T N1.7's (sampler.flow_time = \"groot\"); this flow policy is guided by \
             rtc.prefix_attention_schedule and rtc.max_guidance_weight",
        ));
    }
    let schedule = cx.one_of(
        "rtc.prefix_attention_schedule",
        r.prefix_attention_schedule
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some(Schedule::Linear),
        &Schedule::NAMES,
    )?;
    let g = r.max_guidance_weight.unwrap_or(MAX_GUIDANCE_WEIGHT);
    if !(g.is_finite() && g > 0.0 && g <= 1e6) {
        return Err(cx.invalid(
            "rtc.max_guidance_weight",
            format!("must be a positive number up to 1e6, got {g}"),
        ));
    }
    Ok(Method::Guidance {
        schedule,
        max_guidance_weight: g as f32,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;

    fn config(sampler: &str, rtc: &str, outputs: &str) -> Result<Config, ConfigError> {
        let text = format!(
            r#"
[engine]
model = "prefix.onnx"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32"]
shape = [8]
[[outputs]]
tensor = "x_t"
{outputs}
{sampler}
{rtc}
"#
        );
        Config::parse(&text, "test.toml", Some(Path::new("/tmp")))
    }

    const FLOW: &str = "[denoise]\nmodel = \"step.onnx\"\n[sampler]\nkind = \"flow\"\nsteps = 10\n\
                        x = \"x_t\"\ntime = \"time\"\noutput = \"v_t\"\nflow_time = \"lerobot\"";

    fn settings(sampler: &str, rtc: &str) -> Option<Settings> {
        let c = config(sampler, rtc, "").unwrap_or_else(|e| panic!("{e}"));
        c.default_policy().pipeline.as_ref().and_then(|p| p.rtc)
    }

    fn refusal(sampler: &str, rtc: &str, outputs: &str) -> String {
        match config(sampler, rtc, outputs) {
            Ok(_) => panic!("accepted: {rtc}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_bare_table_turns_on_lerobots_defaults() {
        assert_eq!(settings(FLOW, ""), None);
        assert_eq!(
            settings(FLOW, "[rtc]"),
            Some(Settings {
                execution_horizon: 10,
                inference_delay: None,
                method: Method::Guidance {
                    schedule: Schedule::Linear,
                    max_guidance_weight: 10.0
                },
            })
        );
        assert_eq!(settings(FLOW, "[rtc]\nenabled = false"), None);
        let s = settings(
            FLOW,
            "[rtc]\nexecution_horizon = 4\nprefix_attention_schedule = \"EXP\"\n\
             max_guidance_weight = 2.5\ninference_delay = 0",
        );
        assert_eq!(
            s,
            Some(Settings {
                execution_horizon: 4,
                inference_delay: Some(0),
                method: Method::Guidance {
                    schedule: Schedule::Exp,
                    max_guidance_weight: 2.5
                },
            })
        );
        let groot = FLOW.replace("\"lerobot\"", "\"groot\"");
        assert_eq!(
            settings(&groot, "[rtc]\nrtc_ramp_rate = 3.0").map(|s| s.method),
            Some(Method::Inpaint { ramp_rate: 3.0 })
        );
    }

    #[test]
    fn every_key_is_checked_by_name() {
        for (rtc, key) in [
            ("execution_horizon = 0", "rtc.execution_horizon"),
            (
                "prefix_attention_schedule = \"cosine\"",
                "rtc.prefix_attention_schedule",
            ),
            ("max_guidance_weight = 0.0", "rtc.max_guidance_weight"),
            ("max_guidance_weight = nan", "rtc.max_guidance_weight"),
            ("rtc_ramp_rate = 6.0", "rtc.rtc_ramp_rate"),
        ] {
            let e = refusal(FLOW, &format!("[rtc]\n{rtc}"), "");
            assert!(e.contains(key), "{rtc}: {e}");
        }
        let e = refusal(FLOW, "[rtc]\nhorizon = 3", "");
        assert!(e.contains("horizon"), "{e}");
        let groot = FLOW.replace("\"lerobot\"", "\"groot\"");
        for (rtc, key) in [
            (
                "prefix_attention_schedule = \"linear\"",
                "rtc.prefix_attention_schedule",
            ),
            ("max_guidance_weight = 5.0", "rtc.max_guidance_weight"),
            ("rtc_ramp_rate = -1.0", "rtc.rtc_ramp_rate"),
        ] {
            let e = refusal(&groot, &format!("[rtc]\n{rtc}"), "");
            assert!(e.contains(key), "{rtc}: {e}");
        }
    }

    #[test]
    fn policies_rtc_cannot_guide_are_refused_naming_why() {
        let e = refusal("", "[rtc]", "");
        assert!(e.contains("rtc") && e.contains("ACT"), "{e}");
        let ddim = "[denoise]\nmodel = \"step.onnx\"\n[sampler]\nkind = \"ddim\"\nsteps = 10\n\
                    x = \"x_t\"\ntime = \"t\"\noutput = \"eps\"";
        let e = refusal(ddim, "[rtc]", "");
        assert!(e.contains("rtc") && e.contains("DDIM"), "{e}");
        let model = format!("{FLOW}\nupdate = \"model\"\ndt = \"dt\"");
        let e = refusal(&model, "[rtc]", "");
        assert!(e.contains("velocity"), "{e}");
        let e = refusal(FLOW, "[rtc]", "relative_to = \"state\"");
        assert!(
            e.contains("outputs[0].relative_to") && e.contains("[rtc]"),
            "{e}"
        );
        let e = refusal(FLOW, "[rtc]", "rows = [2, 8]");
        assert!(e.contains("outputs[0].rows"), "{e}");
        assert!(config(FLOW, "[rtc]", "rows = [0, 8]").is_ok());
        // Even turned off, [rtc] where it cannot apply is named (a copied table, a wrong file).
        assert!(config(ddim, "[rtc]\nenabled = false", "").is_err());
    }
}
