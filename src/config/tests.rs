use super::*;
use crate::dtype::ElemType;
use crate::protocol::dialect::ResetReply;

const MIN: &str = r#"
[engine]
model = "m.onnx"
[[inputs]]
key = "state"
tensor = "state"
dtypes = ["float32", "float64"]
shape = [8]
[[outputs]]
tensor = "actions"
"#;

fn err(extra: &str) -> String {
    let text = format!("{MIN}\n{extra}");
    match Config::parse(&text, "test.toml", Some(Path::new("/tmp"))) {
        Ok(_) => panic!("accepted: {extra}"),
        Err(e) => e.to_string(),
    }
}

fn replace(from: &str, to: &str) -> String {
    match Config::parse(&MIN.replace(from, to), "test.toml", Some(Path::new("/tmp"))) {
        Ok(_) => panic!("accepted: {to}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn minimal_config_has_documented_defaults() {
    let c = Config::parse(MIN, "t", Some(Path::new("/etc/policyd"))).unwrap();
    assert_eq!(c.server.host, "127.0.0.1");
    assert_eq!(c.server.port, 8000);
    assert_eq!(c.server.idle_timeout_s, 3600.0);
    assert_eq!(c.server.write_timeout_s, 10.0);
    assert_eq!(c.server.max_connections_per_peer, 4);
    assert_eq!(c.server.ping_interval_s, 20.0);
    let p = c.default_policy();
    assert_eq!(p.outputs[0].key, "actions");
    assert_eq!(p.outputs[0].dtype, ElemType::F32);
    assert_eq!(
        p.model,
        ModelSource::File(PathBuf::from("/etc/policyd/m.onnx"))
    );
    assert_eq!(p.engine.backend, Backend::Cpu);
    assert_eq!(p.engine.zero_copy, ZeroCopy::Auto);
    assert_eq!(c.planner.precedence, Precedence::Client);
    assert_eq!(c.server.reset_reply, ResetReply::Msgpack);
}

#[test]
fn closed_sets_name_the_key_and_every_choice() {
    let e = replace(
        "model = \"m.onnx\"",
        "model = \"m.onnx\"\nbackend = \"gpu\"",
    );
    assert!(
        e.contains("engine.backend")
            && e.contains(r#"must be "cpu", "ort" or "tensorrt", got "gpu""#),
        "{e}"
    );
    let e = replace(
        "model = \"m.onnx\"",
        "model = \"m.onnx\"\nbackend = \"tensorrt\"\nzero_copy = \"yes\"",
    );
    assert!(
        e.contains(r#"engine.zero_copy`: must be "auto", "on" or "off", got "yes""#),
        "{e}"
    );
    let e = replace("shape = [8]", "shape = [8]\nlayout = \"hwc\"");
    assert!(
        e.contains("inputs[0].layout") && e.contains(r#"got "hwc""#),
        "{e}"
    );
    let e = err("[server]\nreset_reply = \"json\"");
    assert!(
        e.contains(r#"server.reset_reply`: must be "msgpack" or "text", got "json""#),
        "{e}"
    );
}

#[test]
fn planner_errors_name_the_key() {
    let on = |extra: &str| {
        err(&format!(
            "[planner]\nenabled = true\nendpoints = [\"http://127.0.0.1:8080\"]\n\
                 model = \"m\"\n{extra}"
        ))
    };
    assert!(err("[planner]\nenabled = true\nmodel = \"m\"").contains("planner.endpoints"));
    assert!(err("[planner]\nenabled = true\nendpoints = [\"http://h\"]").contains("planner.model"));
    let https =
        err("[planner]\nenabled = true\nmodel = \"m\"\nendpoints = [\"http://a\", \"https://b\"]");
    assert!(
        https.contains("planner.endpoints[1]") && https.contains("https"),
        "{https}"
    );
    assert!(on("rate_hz = 0.0").contains("planner.rate_hz"));
    assert!(on("precedence = \"robot\"").contains("planner.precedence"));
    assert!(on("max_tokens = 0").contains("planner.max_tokens"));
    assert!(on("temperature = 3.0").contains("planner.temperature"));
    assert!(on("request_timeout_s = 0.0").contains("planner.request_timeout_s"));
    assert!(on("ready_marker = \"up\"").contains("planner.ready_marker"));
    assert!(on("serve_command = [\"\"]").contains("planner.serve_command"));
    assert!(on("tempo = 1").contains("tempo"));
    // Off (the default), nothing is required.
    let ok = format!("{MIN}\n[planner]\nrate_hz = 2.0");
    assert!(Config::parse(&ok, "t", None).is_ok());
}

#[test]
fn the_api_key_is_never_printed() {
    let text = format!(
        "{MIN}\n[planner]\nenabled = true\nendpoints = [\"http://h\"]\nmodel = \"m\"\n\
             api_key = \"sk-secret-123\""
    );
    let cfg = Config::parse(&text, "t", None).expect("parses");
    assert!(!format!("{cfg:?}").contains("sk-secret-123"));
}

#[test]
fn lerobot_section_is_checked_key_by_key() {
    let ok = |extra: &str| {
        Config::parse(&format!("{MIN}\n{extra}"), "test.toml", None)
            .unwrap_or_else(|e| panic!("{extra}: {e}"))
    };
    assert_eq!(ok("").lerobot, None, "off without the section");
    let c = ok(
        "[lerobot]\nlisten = \"0.0.0.0:8080\"\nallow = [\"10.0.0.0/8\", \"192.168.1.7\"]\n\
                    [[lerobot.serve]]\npretrained = \"user/act\"\npolicy_type = \"act\"",
    )
    .lerobot
    .expect("on");
    assert_eq!(c.listen.port(), 8080);
    assert_eq!(c.allow.len(), 2);
    assert_eq!(c.long_poll, std::time::Duration::from_millis(2000));
    assert_eq!(c.resize, LerobotResize::Bilinear);
    assert_eq!(c.max_connections, 16);
    assert_eq!(c.idle_timeout, std::time::Duration::from_secs(120));
    assert_eq!(c.takeover_after, std::time::Duration::from_secs(10));
    assert_eq!(
        c.serve[0].policy, "default",
        "the default policy when none is named"
    );
    for (extra, key) in [
        ("[lerobot]", "lerobot.listen"),
        ("[lerobot]\nlisten = \"8080\"", "lerobot.listen"),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nallow = [\"10.0.0/8\"]",
            "lerobot.allow",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nlong_poll_ms = 0",
            "lerobot.long_poll_ms",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nmax_payload_bytes = 10",
            "lerobot.max_payload_bytes",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nresize = \"nearest\"",
            "lerobot.resize",
        ),
        ("[lerobot]\nlisten = \"0.0.0.0:1\"\nport = 1", "port"),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\n[[lerobot.serve]]\npretrained = \"a\"\npolicy = \"b\"",
            "lerobot.serve[0].policy",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\n[[lerobot.serve]]\npretrained = \" \"",
            "lerobot.serve[0].pretrained",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nmax_connections = 0",
            "lerobot.max_connections",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nhandshake_timeout_s = 0",
            "lerobot.handshake_timeout_s",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nidle_timeout_s = 1",
            "lerobot.idle_timeout_s",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nchunk_timeout_s = nan",
            "lerobot.chunk_timeout_s",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\nchunk_timeout_s = 20",
            "lerobot.observation_timeout_s",
        ),
        (
            "[lerobot]\nlisten = \"0.0.0.0:1\"\ntakeover_after_s = -1",
            "lerobot.takeover_after_s",
        ),
    ] {
        let e = err(extra);
        assert!(e.contains(key), "{extra}: {e}");
    }
}

#[test]
fn errors_name_the_key() {
    assert!(err("[server]\nmax_connections = 0").contains("server.max_connections"));
    assert!(err("[server]\nmax_message_bytes = 10").contains("server.max_message_bytes"));
    assert!(err("[server]\nping_timeout_s = -1.0").contains("server.ping_timeout_s"));
    assert!(err("[server]\nreset_reply = \"json\"").contains("server.reset_reply"));
    assert!(
        err("[server]\nportt = 1").contains("portt"),
        "unknown keys are refused"
    );
    assert!(
        replace(
            "dtypes = [\"float32\", \"float64\"]",
            "dtypes = [\"float33\"]"
        )
        .contains("inputs[0].dtypes")
    );
    assert!(
        replace("dtypes = [\"float32\", \"float64\"]", "dtypes = []").contains("inputs[0].dtypes")
    );
    assert!(
        replace("shape = [8]", "shape = [8]\nlayout = \"hwc_to_chw\"").contains("inputs[0].layout")
    );
    assert!(
        replace(
            "shape = [8]",
            "shape = [8]\nmean = [0.0, 1.0]\nstd = [1.0, 1.0]"
        )
        .contains("inputs[0].mean")
    );
    assert!(replace("shape = [8]", "shape = [8]\nmean = [0.0]").contains("inputs[0].mean"));
    // Shapes whose element count overflows (found by the config fuzzer) or is beyond any
    // buffer; an engine_shape likewise.
    for shape in ["[4444444444444444443, 224, 224]", "[65536, 65536]"] {
        let e = replace("shape = [8]", &format!("shape = {shape}"));
        assert!(
            e.contains("inputs[0].shape") && e.contains("elements"),
            "{e}"
        );
    }
    assert!(
        replace(
            "shape = [8]",
            "shape = [8]\nengine_shape = [1, 4294967296, 4294967296]"
        )
        .contains("inputs[0].engine_shape")
    );
    assert!(
        replace("shape = [8]", "shape = [8]\nengine_shape = [1, 0]")
            .contains("inputs[0].engine_shape")
    );
    assert!(replace("key = \"state\"", "key = \"endpoint\"").contains("inputs[0].key"));
    assert!(
        replace(
            "tensor = \"actions\"",
            "tensor = \"actions\"\ndtype = \"int8\""
        )
        .contains("outputs[0].dtype")
    );
    assert!(
        replace(
            "model = \"m.onnx\"",
            "model = \"m.onnx\"\nbackend = \"gpu\""
        )
        .contains("engine.backend")
    );
    // Un-normalisation coefficients past float32 (every vllm-omni reply is float32).
    let wide = |mean: &str, std: &str| {
        replace(
            "tensor = \"actions\"",
            &format!("tensor = \"actions\"\ndtype = \"float64\"\nmean = [{mean}]\nstd = [{std}]"),
        )
    };
    let e = wide("1e39", "1.0");
    assert!(
        e.contains("outputs[0].mean") && e.contains("float32"),
        "{e}"
    );
    let e = wide("0.0", "3.5e38");
    assert!(e.contains("outputs[0].std") && e.contains("float32"), "{e}");
    // allow_non_finite is for numeric inputs.
    let text = format!(
        "{MIN}\n[[inputs]]\nkey = \"prompt\"\ntensor = \"p\"\ndtypes = [\"text\"]\nshape = [8]\nallow_non_finite = true\n"
    );
    let e = Config::parse(&text, "t", Some(Path::new(".")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("inputs[1].dtypes") && e.contains("allow_non_finite"),
        "{e}"
    );
    assert!(err("[metadata]\nwhen = 1979-05-27").contains("metadata.when"));
    let dup = format!(
        "{MIN}\n[[inputs]]\nkey = \"state\"\ntensor = \"x\"\ndtypes = [\"float32\"]\nshape = [1]\n"
    );
    let e = Config::parse(&dup, "t", Some(Path::new(".")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("inputs[1].key"), "{e}");
}

#[test]
fn parse_errors_say_where() {
    let e = Config::parse("[server\nport = 1", "bad.toml", None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.toml"), "{e}");
    let e = Config::parse(
        "[server]\nport = \"x\"\n[engine]\nmodel=\"m\"",
        "bad.toml",
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("port"), "{e}");
}

#[test]
fn the_packaged_default_config_serves_the_demo_bindings() {
    let packaged = Config::parse(
        include_str!("../../systemd/policyd.toml"),
        "systemd/policyd.toml",
        None,
    )
    .unwrap();
    let demo = Config::parse(include_str!("../../configs/aloha.toml"), "aloha", None).unwrap();
    let (p, d) = (packaged.default_policy(), demo.default_policy());
    assert_eq!(p.inputs, d.inputs);
    assert_eq!(p.outputs, d.outputs);
    assert_eq!(p.metadata, d.metadata);
    assert_eq!(packaged.server.host, "0.0.0.0");
    assert_eq!(
        p.model,
        ModelSource::File(PathBuf::from("/usr/share/policyd/models/aloha.onnx"))
    );
}
