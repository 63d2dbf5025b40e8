//! Tokenized prompts (`[inputs.tokenizer]`) through the bindings: what the engine's ids and
//! mask inputs hold after a decode, the session cache, truncation and refusal, pi0.5 state
//! bins, the planner's subtask, and the start-up errors, each naming its key. Token-for-token
//! agreement with openpi's Python tokenizer is checked by tests/interop/test_tokenizer.py;
//! here the reference is the library's own `Tokenizer`, so what is tested is the binding.

use policyd::bind::{Plan, PromptCache};
use policyd::config::Config;
use policyd::dtype::ElemType;
use policyd::engine::{HostBuffer, InputBuffer, IoSpec, TensorSpec};
use policyd::protocol::{Encoder, WireError};
use policyd::tokenizer::{Around, Format, Tokenizer, state_bin};

const MODEL: &str = "models/tokenizer/bpe.model";

/// A policy with a state [4] and a tokenized prompt; `tokenizer` is the `[inputs.tokenizer]`
/// body after `file`, `state` the state binding's extra lines.
fn config(state: &str, tokenizer: &str) -> String {
    format!(
        r#"
[engine]
model = "synthetic"
[[inputs]]
key = "state"
dtypes = ["float64"]
shape = [4]
{state}
[[inputs]]
key = "prompt"
tensor = "ids"
dtypes = ["text"]
[inputs.tokenizer]
file = "{MODEL}"
max_tokens = 16
mask_tensor = "mask"
{tokenizer}
[[outputs]]
tensor = "actions"
"#
    )
}

fn spec(name: &str, dtype: ElemType, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

fn io(ids: ElemType, mask_len: usize, state: bool) -> IoSpec {
    let mut inputs = vec![
        spec("ids", ids, &[1, 16]),
        spec("mask", ElemType::Bool, &[1, mask_len]),
    ];
    if state {
        inputs.push(spec("state", ElemType::F32, &[1, 4]));
    }
    IoSpec {
        inputs,
        outputs: vec![spec("actions", ElemType::F32, &[1, 10, 7])],
    }
}

fn compile(text: &str, io: &IoSpec) -> Result<Plan, String> {
    let cfg = Config::parse(text, "test", None).map_err(|e| e.to_string())?;
    Plan::compile(&cfg, cfg.default_policy(), io).map_err(|e| e.to_string())
}

fn pi0() -> Plan {
    compile(
        &config("tensor = \"state\"", "format = \"pi0\""),
        &io(ElemType::I64, 16, true),
    )
    .unwrap()
}

/// A slot's buffers for `plan`: its engine inputs, then its host buffers.
fn buffers(plan: &Plan) -> Vec<Box<dyn InputBuffer>> {
    plan.io
        .inputs
        .iter()
        .map(|s| s.bytes())
        .chain(plan.host_buffers.iter().copied())
        .map(|n| Box::new(HostBuffer(vec![0; n])) as Box<dyn InputBuffer>)
        .collect()
}

/// `{"state": [4 floats], "prompt": prompt}` (prompt already msgpack).
fn frame(state: [f64; 4], prompt: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(2);
    e.str("state");
    e.ndarray(ElemType::F64, &[4], 32, |d| {
        for (c, v) in d.chunks_exact_mut(8).zip(state) {
            c.copy_from_slice(&v.to_le_bytes());
        }
    });
    e.str("prompt");
    buf.extend_from_slice(prompt);
    buf
}

/// `{"state": [4 zeros]}`: a request without a prompt.
fn state_only() -> Vec<u8> {
    let mut buf = Vec::new();
    let mut e = Encoder { buf: &mut buf };
    e.map(1);
    e.str("state");
    e.ndarray(ElemType::F64, &[4], 32, |d| d.fill(0));
    buf
}

fn text(s: &str) -> Vec<u8> {
    let mut v = Vec::new();
    Encoder { buf: &mut v }.str(s);
    v
}

/// Decodes and tokenizes; returns (ids, mask, what tokenize did).
fn run(
    plan: &Plan,
    bufs: &mut [Box<dyn InputBuffer>],
    cache: &mut PromptCache,
    frame: &[u8],
) -> Result<(Vec<i64>, Vec<bool>, policyd::bind::Tokenized), WireError> {
    let mut seen = vec![false; plan.inputs.len()];
    plan.decode(frame, bufs, &mut seen)?;
    let t = plan.tokenize(bufs, cache)?;
    let ty = plan.io.inputs[0].dtype;
    let ids = bufs[0]
        .bytes_mut()
        .chunks_exact(ty.size())
        .map(|c| match ty {
            ElemType::I64 => i64::from_le_bytes(c.try_into().unwrap()),
            ElemType::I32 => i32::from_le_bytes(c.try_into().unwrap()).into(),
            _ => f32::from_le_bytes(c.try_into().unwrap()) as i64,
        })
        .collect();
    let mask = bufs[1].bytes_mut().iter().map(|&b| b != 0).collect();
    Ok((ids, mask, t))
}

fn reference(format: Format, prompt: &str, bins: &[i16]) -> Vec<u32> {
    let tok = Tokenizer::load(&std::fs::read(MODEL).unwrap(), None).unwrap();
    let mut ids = Vec::new();
    tok.tokenize(format, prompt, bins, Around::NONE, &mut ids)
        .unwrap();
    ids
}

/// `ids` padded to 16 with `pad`, and its mask.
fn laid_out(ids: &[u32], pad: i64) -> (Vec<i64>, Vec<bool>) {
    (
        (0..16)
            .map(|k| ids.get(k).map_or(pad, |&i| i64::from(i)))
            .collect(),
        (0..16).map(|k| k < ids.len()).collect(),
    )
}

#[test]
fn ids_and_mask_are_written_and_cached_per_session() {
    let plan = pi0();
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    let prompt = "put the bowl on the plate";
    let want = reference(Format::Pi0, prompt, &[]);
    assert_eq!(want[0], 1, "BOS first");
    let (ids, mask, t) = run(
        &plan,
        &mut bufs,
        &mut cache,
        &frame([0.0; 4], &text(prompt)),
    )
    .unwrap();
    assert_eq!((ids, mask), laid_out(&want, 0));
    assert!(t.encoded && t.truncated.is_none());
    // Unchanged: from the cache (the slot's buffers hold something else meanwhile).
    bufs[0].bytes_mut().fill(0xff);
    let (ids, mask, t) = run(
        &plan,
        &mut bufs,
        &mut cache,
        &frame([1.0; 4], &text(prompt)),
    )
    .unwrap();
    assert_eq!((ids, mask), laid_out(&want, 0));
    assert!(!t.encoded);
    // Changed: tokenized again.
    let other = "fold the towel";
    let (ids, _, t) = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &text(other))).unwrap();
    assert_eq!(ids, laid_out(&reference(Format::Pi0, other, &[]), 0).0);
    assert!(t.encoded);
    // A cache filled for another plan (a reload) is not trusted.
    let again = pi0();
    let (_, _, t) = run(
        &again,
        &mut bufs,
        &mut cache,
        &frame([0.0; 4], &text(other)),
    )
    .unwrap();
    assert!(t.encoded);
    // The empty prompt: openpi's BOS + "\n".
    let (ids, _, _) = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &text(""))).unwrap();
    assert_eq!(ids, laid_out(&reference(Format::Pi0, "", &[]), 0).0);
    assert!(ids[1] != 0 && ids[2] == 0, "BOS and the newline: {ids:?}");
}

#[test]
fn pad_id_dtype_and_numpy_strings() {
    let plan = compile(
        &config("tensor = \"state\"", "format = \"plain\"\npad_id = 7"),
        &io(ElemType::F32, 16, true),
    )
    .unwrap();
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    // numpy `<U` (UTF-32), as openpi-client sends np.str_.
    let mut u = Vec::new();
    let mut e = Encoder { buf: &mut u };
    e.map(4);
    e.bin(b"__ndarray__");
    e.bool(true);
    e.bin(b"data");
    e.bin(&[b'c', 0, 0, 0, b'u', 0, 0, 0, b'p', 0, 0, 0]);
    e.bin(b"dtype");
    e.str("<U3");
    e.bin(b"shape");
    e.array(0);
    let (ids, mask, _) = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &u)).unwrap();
    assert_eq!(
        (ids, mask),
        laid_out(&reference(Format::Plain, "cup", &[]), 7)
    );
}

#[test]
fn long_prompts_are_truncated_once_warned_or_refused() {
    let plan = pi0();
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    let long = "pick up the red block and put it in the basket ".repeat(4);
    let want = reference(Format::Pi0, &long, &[]);
    assert!(want.len() > 16);
    let (ids, mask, t) = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &text(&long))).unwrap();
    assert_eq!((ids, mask), laid_out(&want[..16], 0));
    assert_eq!((t.truncated, t.first_truncation), (Some(want.len()), true));
    let (_, _, t) = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &text(&long))).unwrap();
    assert_eq!((t.truncated, t.first_truncation), (Some(want.len()), false));
    // 1 MiB: only the first max_prompt_bytes are read, and the tokens kept are openpi's.
    let huge: String = "put the bowl on the plate ".repeat(40_330);
    assert!(huge.len() > 1 << 20);
    let (ids, _, t) = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &text(&huge))).unwrap();
    assert_eq!(
        ids,
        laid_out(&reference(Format::Pi0, &huge, &[])[..16], 0).0
    );
    let b = &plan.inputs[plan.tokens.unwrap()];
    let read = b.tokens.as_ref().unwrap().prompt_bytes;
    assert!(read < 4096, "reads {read} bytes");
    assert!(
        t.truncated.unwrap() < read + 3,
        "tokenized only what was read"
    );

    let refuse = compile(
        &config(
            "tensor = \"state\"",
            "format = \"pi0\"\noverflow = \"refuse\"",
        ),
        &io(ElemType::I64, 16, true),
    )
    .unwrap();
    let e = run(
        &refuse,
        &mut bufs,
        &mut cache,
        &frame([0.0; 4], &text(&long)),
    )
    .unwrap_err();
    assert!(
        matches!(&e, WireError::TooManyTokens { key, max: 16, .. } if key == "prompt"),
        "{e}"
    );
    assert!(e.to_string().contains("overflow"), "{e}");
    let e = run(
        &refuse,
        &mut bufs,
        &mut cache,
        &frame([0.0; 4], &text(&huge)),
    )
    .unwrap_err();
    assert!(matches!(e, WireError::TextTooLong { .. }), "{e}");
    assert!(e.to_string().contains("max_prompt_bytes"), "{e}");
}

#[test]
fn bad_prompts_are_refused_naming_the_key() {
    let plan = pi0();
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    let mut arr = Vec::new();
    Encoder { buf: &mut arr }.ndarray(ElemType::F32, &[1], 4, |d| d.fill(0));
    let mut bad_utf8 = Vec::new();
    Encoder { buf: &mut bad_utf8 }.bin(&[0xff, 0xfe]);
    for (prompt, what) in [(arr, "an array"), (bad_utf8, "invalid UTF-8")] {
        let e = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &prompt)).unwrap_err();
        assert!(e.to_string().contains("'prompt'"), "{what}: {e}");
    }
    let no_prompt = state_only();
    let e = run(&plan, &mut bufs, &mut cache, &no_prompt).unwrap_err();
    assert!(matches!(e, WireError::MissingKey { .. }), "{e}");
}

#[test]
fn pi05_discretises_the_normalised_state_even_without_an_engine_input() {
    // The state feeds only the prompt: no `tensor`, normalised by its mean and std.
    let plan = compile(
        &config(
            "mean = [1.0]\nstd = [2.0]",
            "format = \"pi05\"\nstate_key = \"state\"",
        ),
        &io(ElemType::I32, 16, false),
    )
    .unwrap();
    assert_eq!(
        plan.host_buffers.len(),
        2,
        "the prompt's text and the state"
    );
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    let state = [1.0, 3.0, -1.0, 100.0];
    // (x - 1) / (2 + 1e-6), in float32 as the engine would hold it.
    let bins: Vec<i16> = state
        .iter()
        .map(|x| state_bin(f64::from(((x - 1.0) / (2.0 + 1e-6)) as f32)))
        .collect();
    assert_eq!(bins, [128, 255, 0, 255]);
    let want = reference(Format::Pi05, "fold it", &bins);
    let (ids, _, t) = run(
        &plan,
        &mut bufs,
        &mut cache,
        &frame(state, &text("fold it")),
    )
    .unwrap();
    assert_eq!(ids, laid_out(&want[..want.len().min(16)], 0).0);
    assert!(t.encoded);
    // Same bins: cached; another bin: tokenized again.
    let (_, _, t) = run(
        &plan,
        &mut bufs,
        &mut cache,
        &frame([1.001, 3.0, -1.0, 99.0], &text("fold it")),
    )
    .unwrap();
    assert!(!t.encoded);
    let (_, _, t) = run(
        &plan,
        &mut bufs,
        &mut cache,
        &frame([1.5, 3.0, -1.0, 99.0], &text("fold it")),
    )
    .unwrap();
    assert!(t.encoded);
}

/// openpi's DROID state is two request keys (joints, then the gripper, which a client may
/// send as a bare number): `state_key` lists both, and the bins are theirs in that order.
#[test]
fn pi05_state_from_several_keys_is_concatenated_in_order() {
    let text_cfg = config("mean = [1.0]\nstd = [2.0]", "format = \"pi05\"\nstate_key = [\"state\", \"grip\"]")
        .replace(
            "[[inputs]]\nkey = \"prompt\"",
            "[[inputs]]\nkey = \"grip\"\ndtypes = [\"float64\"]\nshape = [1]\nmin = [0.0]\nmax = [2.0]\n[[inputs]]\nkey = \"prompt\"",
        );
    let plan = compile(&text_cfg, &io(ElemType::I32, 16, false)).unwrap();
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    let mut msg = Vec::new();
    let mut e = Encoder { buf: &mut msg };
    e.map(3);
    e.str("grip");
    e.f64(1.5);
    e.str("state");
    e.ndarray(ElemType::F64, &[4], 32, |d| {
        for (c, v) in d.chunks_exact_mut(8).zip([1.0f64, 3.0, -1.0, 100.0]) {
            c.copy_from_slice(&v.to_le_bytes());
        }
    });
    e.str("prompt");
    msg.extend_from_slice(&text("fold it"));
    // The state's four bins (as in the test above), then the gripper's: 2·1.5/2 − 1 = 0.5.
    let bins = [128, 255, 0, 255, state_bin(0.5)];
    let want = reference(Format::Pi05, "fold it", &bins);
    let (ids, _, _) = run(&plan, &mut bufs, &mut cache, &msg).unwrap();
    assert_eq!(ids, laid_out(&want[..want.len().min(16)], 0).0);
    // Listed twice, or naming no input: refused, naming the key.
    for (keys, says) in [
        ("[\"state\", \"grip\", \"state\"]", "twice"),
        (
            "[\"state\", \"grip\", \"wrist\"]",
            "names no [[inputs]] key",
        ),
    ] {
        let bad = text_cfg.replace("[\"state\", \"grip\"]", keys);
        let e = compile(&bad, &io(ElemType::I32, 16, false)).unwrap_err();
        assert!(
            e.contains("inputs[2].tokenizer.state_key") && e.contains(says),
            "{keys}: {e}"
        );
    }
}

/// openpi's `InjectDefaultPrompt` (ALOHA sim's "Transfer cube"): a request without a prompt
/// gets the default, one with a prompt (even an empty one) keeps its own.
#[test]
fn a_request_without_a_prompt_gets_the_default_prompt() {
    let text_cfg = config(
        "tensor = \"state\"",
        "format = \"pi0\"\ndefault_prompt = \"Transfer cube\"",
    );
    let plan = compile(&text_cfg, &io(ElemType::I64, 16, true)).unwrap();
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    let no_prompt = state_only();
    let (ids, _, _) = run(&plan, &mut bufs, &mut cache, &no_prompt).unwrap();
    assert_eq!(
        ids,
        laid_out(&reference(Format::Pi0, "Transfer cube", &[]), 0).0
    );
    for own in ["", "fold it"] {
        let (ids, _, _) = run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &text(own))).unwrap();
        assert_eq!(
            ids,
            laid_out(&reference(Format::Pi0, own, &[]), 0).0,
            "{own:?}"
        );
    }
    // Longer than the prompt bytes read: refused at start-up, naming the key.
    let long = text_cfg.replace(
        "default_prompt = \"Transfer cube\"",
        "default_prompt = \"Transfer cube\"\nmax_prompt_bytes = 8",
    );
    let e = compile(&long, &io(ElemType::I64, 16, true)).unwrap_err();
    assert!(e.contains("inputs[1].tokenizer.default_prompt"), "{e}");
}

/// GR00T: the prompt cleaned as GR00T's `prepare_n1_7_language_batch` does and encoded between
/// the chat template's fixed ids; a request without a task gets GR00T's default task.
#[test]
fn groot_puts_the_cleaned_task_between_the_template_ids() {
    let text_cfg = config(
        "tensor = \"state\"",
        "format = \"groot\"\nprefix_ids = [3, 4, 5]\nsuffix_ids = [6]\ndefault_prompt = \"\"",
    );
    let plan = compile(&text_cfg, &io(ElemType::I64, 16, true)).unwrap();
    let mut bufs = buffers(&plan);
    let mut cache = PromptCache::default();
    let tok = Tokenizer::load(&std::fs::read(MODEL).unwrap(), None).unwrap();
    let expect = |task: &str| {
        let mut ids = Vec::new();
        tok.tokenize(Format::Plain, task, &[], Around::NONE, &mut ids)
            .unwrap();
        let bos = usize::from(tok.bos().is_some());
        let mut all = vec![3, 4, 5];
        all.extend_from_slice(&ids[bos..]);
        all.push(6);
        let mut full = tok.bos().into_iter().collect::<Vec<_>>();
        full.extend(all);
        laid_out(&full, 0)
    };
    for (sent, cleaned) in [
        ("Pick UP the cube!", "pick up the cube"),
        ("fold_the towel, now.", "fold_the towel now"),
        ("", "perform the task"),
        ("?!", "Perform the task."),
    ] {
        let (ids, mask, _) =
            run(&plan, &mut bufs, &mut cache, &frame([0.0; 4], &text(sent))).unwrap();
        assert_eq!((ids, mask), expect(cleaned), "{sent:?}");
    }
    let (ids, _, _) = run(&plan, &mut bufs, &mut cache, &state_only()).unwrap();
    assert_eq!(ids, expect("perform the task").0);
    // groot_raw keeps the task as sent.
    let raw = compile(
        &text_cfg.replace("\"groot\"", "\"groot_raw\""),
        &io(ElemType::I64, 16, true),
    )
    .unwrap();
    let mut bufs = buffers(&raw);
    let (ids, _, _) = run(
        &raw,
        &mut bufs,
        &mut cache,
        &frame([0.0; 4], &text("Pick!")),
    )
    .unwrap();
    assert_eq!(ids, expect("Pick!").0);
}

#[test]
fn the_planners_subtask_is_tokenized_too() {
    let text_cfg = format!(
        "{}\n[planner]\nenabled = true\nendpoints = [\"http://127.0.0.1:9\"]\nmodel = \"m\"\n",
        config("tensor = \"state\"", "format = \"pi0\"")
    );
    let plan = compile(&text_cfg, &io(ElemType::I64, 16, true)).unwrap();
    let cfg = Config::parse(&text_cfg, "test", None).unwrap();
    let link = plan.planner.as_ref().unwrap().link(&cfg.planner);
    link.publish(&policyd::planner::reply::Answer {
        subtask: "grasp the handle".into(),
        done: false,
    });
    let no_prompt = state_only();
    let mut bufs = buffers(&plan);
    let mut seen = vec![false; plan.inputs.len()];
    plan.decode_with(&no_prompt, &mut bufs, &mut seen, Some(&link))
        .unwrap();
    plan.tokenize(&mut bufs, &mut PromptCache::default())
        .unwrap();
    let ids: Vec<i64> = bufs[0]
        .bytes_mut()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(
        ids,
        laid_out(&reference(Format::Pi0, "grasp the handle", &[]), 0).0
    );
}

#[test]
fn start_up_errors_name_the_key() {
    let state = "tensor = \"state\"";
    let good = io(ElemType::I64, 16, true);
    let err = |cfg: String, io: &IoSpec| compile(&cfg, io).unwrap_err();
    let cases: Vec<(String, IoSpec, &str, &str)> = vec![
        (
            config(state, "format = \"pi0\"").replace(MODEL, "models/tokenizer/missing.model"),
            good.clone(),
            "inputs[1].tokenizer.file",
            "cannot read",
        ),
        (
            config(state, "format = \"pi0\"").replace(MODEL, "models/tiny.onnx"),
            good.clone(),
            "inputs[1].tokenizer.file",
            "neither a SentencePiece model nor a Hugging Face tokenizer.json",
        ),
        (
            config(state, "format = \"pi0\""),
            io(ElemType::I8, 16, true),
            "inputs[1].tensor",
            "cannot hold every id",
        ),
        (
            config(state, "format = \"pi0\""),
            io(ElemType::I64, 12, true),
            "inputs[1].tokenizer.mask_tensor",
            "max_tokens = 16",
        ),
        (
            config(state, "format = \"pi05\""),
            good.clone(),
            "inputs[1].tokenizer.state_key",
            "pi05",
        ),
        (
            config(state, "format = \"pi0\"\nstate_key = \"state\""),
            good.clone(),
            "inputs[1].tokenizer.state_key",
            "only format",
        ),
        (
            config(state, "format = \"pi05\"\nstate_key = \"joints\""),
            good.clone(),
            "inputs[1].tokenizer.state_key",
            "names no [[inputs]] key",
        ),
        (
            config(state, "format = \"pi1\""),
            good.clone(),
            "inputs[1].tokenizer.format",
            "\"pi0\", \"pi05\", \"plain\", \"lerobot\", \"groot\" or \"groot_raw\"",
        ),
        (
            config(state, "format = \"pi0\"\nprefix_ids = [1, 2]"),
            good.clone(),
            "inputs[1].tokenizer.prefix_ids",
            "only formats \"groot\"",
        ),
        (
            config(state, "format = \"groot\"\nsuffix_ids = [1, 1000000]"),
            good.clone(),
            "inputs[1].tokenizer.suffix_ids",
            "entry 1 is id 1000000",
        ),
        (
            config(
                state,
                "format = \"groot\"\nprefix_ids = [1, 2, 3, 4, 5, 6, 7, 8]",
            )
            .replace("max_tokens = 16", "max_tokens = 8"),
            good.clone(),
            "inputs[1].tokenizer.max_tokens",
            "leaving no room for a prompt",
        ),
        (
            config(state, "format = \"pi0\"").replace("max_tokens = 16", "max_tokens = 0"),
            good.clone(),
            "inputs[1].tokenizer.max_tokens",
            "between",
        ),
        (
            config(state, "format = \"pi0\"\nbos = \"<s>\""),
            good.clone(),
            "inputs[1].tokenizer.bos",
            "tokenizer.json",
        ),
        (
            config(state, "format = \"pi0\"\noverflow = \"drop\""),
            good.clone(),
            "inputs[1].tokenizer.overflow",
            "\"truncate\" or \"refuse\"",
        ),
        (
            config(state, "format = \"pi0\"")
                .replace("dtypes = [\"text\"]", "dtypes = [\"int64\"]"),
            good.clone(),
            "inputs[1].dtypes",
            "text",
        ),
        (
            config(state, "format = \"pi0\"")
                .replace("dtypes = [\"text\"]", "dtypes = [\"text\"]\nshape = [16]"),
            good.clone(),
            "inputs[1].shape",
            "max_tokens",
        ),
        (
            config("", "format = \"pi0\""),
            good.clone(),
            "inputs[0].tensor",
            "state_key",
        ),
        (
            config(state, "format = \"pi0\"")
                .replace("mask_tensor = \"mask\"", "mask_tensor = \"ids\""),
            good.clone(),
            "inputs[1].tokenizer.mask_tensor",
            "its own input",
        ),
        (
            config(state, "format = \"pi0\"")
                .replace("mask_tensor = \"mask\"", "mask_tensor = \"state\""),
            good.clone(),
            "inputs[1].tensor",
            "already bound",
        ),
    ];
    for (cfg, io, key, says) in cases {
        let e = err(cfg, &io);
        assert!(
            e.contains(&format!("`{key}`")) && e.contains(says),
            "want {key} / {says}: {e}"
        );
    }
    let bytelevel = config(state, "format = \"plain\"\nbos = \"<bos>\"")
        .replace(MODEL, "models/tokenizer/bytelevel.json");
    let e = err(bytelevel, &good);
    assert!(
        e.contains("inputs[1].tokenizer.file") && e.contains("no token \"<bos>\""),
        "{e}"
    );
}
