//! LeRobot's pickles, read without executing anything: the real client's payloads (written by
//! lerobot 0.6.1 with numpy 2, tests/fixtures/lerobot/generate.py) lower to the values they
//! hold, and hostile or broken ones are refused with an error that names what was wrong.

use crate::common;

use common::MOTORS;
use policyd::dtype::ElemType;
use policyd::protocol::lerobot::pickle::{PickleError, PickleLimits, PickleReader};
use policyd::protocol::lerobot::{self, LerobotError, ObsValue};

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/lerobot/{name}.pkl",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[derive(Debug, PartialEq)]
struct Seen {
    timestamp: f64,
    timestep: i64,
    must_go: bool,
    motors: Vec<(String, f64)>,
    task: String,
    cameras: Vec<(String, Vec<usize>, Vec<u8>)>,
}

fn read_observation(payload: &[u8]) -> Result<Seen, LerobotError> {
    let mut reader = PickleReader::new(PickleLimits::default());
    lerobot::sniff(payload)?;
    let tree = reader.read(payload)?;
    let obs = lerobot::pickled::observation(&tree)?;
    let mut seen = Seen {
        timestamp: obs.timestamp,
        timestep: obs.timestep,
        must_go: obs.must_go,
        motors: vec![],
        task: String::new(),
        cameras: vec![],
    };
    for e in obs.entries() {
        match e? {
            (k, ObsValue::Number(v)) => seen.motors.push((k.into(), v)),
            (_, ObsValue::Text(t)) => seen.task = t.into(),
            (k, ObsValue::Array(a)) => {
                assert_eq!(a.dtype, ElemType::U8);
                seen.cameras
                    .push((k.into(), a.shape.to_vec(), a.data.to_vec()));
            }
        }
    }
    Ok(seen)
}

fn check_common(s: &Seen) {
    assert_eq!(s.timestamp, 1767225600.123456);
    assert_eq!(s.timestep, 7);
    assert!(s.must_go);
    assert_eq!(s.task, "pick the cube");
    let names: Vec<&str> = s.motors.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, MOTORS, "motors in the client's order");
    for (i, (_, v)) in s.motors.iter().enumerate() {
        assert_eq!(*v, 1.5 + 10.0 * i as f64);
    }
}

#[test]
fn the_clients_observations_lower_to_their_values_under_protocols_4_and_5() {
    let p4 = read_observation(&fixture("observation_p4")).unwrap();
    let p5 = read_observation(&fixture("observation_p5")).unwrap();
    check_common(&p4);
    check_common(&p5);
    assert_eq!(p4.cameras[0].0, "front");
    assert_eq!(p4.cameras[0].1, [4, 6, 3]);
    // numpy's generator with seed 1: the frame's first pixels, as pickletools shows them.
    assert_eq!(p4.cameras[0].2[..4], [0xff, 0xe4, 0x22, 0x79]);
    assert_eq!(
        p4, p5,
        "protocol 5's _frombuffer gives what protocol 4's _reconstruct does"
    );
}

#[test]
fn a_second_camera_reuses_the_memoised_dtype_and_numpy_scalars_are_numbers() {
    let two = read_observation(&fixture("observation_two_cameras")).unwrap();
    check_common(&two);
    let one = read_observation(&fixture("observation_p4")).unwrap();
    assert_eq!(two.cameras[0], one.cameras[0]);
    assert_eq!(two.cameras[1].0, "wrist");
    assert_eq!(two.cameras[1].1, [2, 3, 3]);
    let scalars = read_observation(&fixture("observation_numpy_scalars")).unwrap();
    check_common(&scalars);
    let large = read_observation(&fixture("observation_large")).unwrap();
    check_common(&large);
    assert_eq!(large.cameras[0].1, [100, 240, 3]);
    assert_eq!(large.cameras[0].2.len(), 72_000);
}

#[test]
fn the_policy_config_lowers_with_its_features_in_the_clients_order() {
    let payload = fixture("config");
    let mut reader = PickleReader::new(PickleLimits::default());
    let tree = reader.read(&payload).unwrap();
    let setup = lerobot::pickled::policy_setup(&tree).unwrap();
    assert_eq!(setup.policy_type, "act");
    assert_eq!(setup.pretrained_name_or_path, "user/act_so101");
    assert_eq!(setup.actions_per_chunk, 10);
    assert_eq!(setup.device, "cpu");
    assert!(setup.rename_map.is_empty());
    assert_eq!(setup.features.len(), 2);
    assert_eq!(setup.features[0].key, "observation.state");
    assert_eq!(setup.features[0].shape, [6]);
    assert_eq!(setup.features[0].names, MOTORS);
    assert_eq!(setup.features[1].key, "observation.images.front");
    assert_eq!(setup.features[1].dtype, "image");
    assert_eq!(setup.features[1].shape, [4, 6, 3]);
    // The config is not an observation, and the reverse.
    assert!(lerobot::pickled::observation(&tree).is_err());
    let obs = fixture("observation_p4");
    let tree = reader.read(&obs).unwrap();
    let e = lerobot::pickled::policy_setup(&tree)
        .unwrap_err()
        .to_string();
    assert!(e.contains("RemotePolicyConfig"), "{e}");
}

#[test]
fn globals_off_the_allow_list_are_refused_by_name_and_never_resolved() {
    for (file, pair) in [
        ("attack_os_system", "posix.system"),
        ("attack_builtins_eval", "builtins.eval"),
        ("attack_subprocess_popen", "subprocess.Popen"),
    ] {
        let e = read_observation(&fixture(file)).unwrap_err();
        assert!(
            matches!(e, LerobotError::Pickle(PickleError::Global { .. })),
            "{file}: {e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains(pair), "{file}: {msg}");
        assert!(msg.contains("allow-list"), "{msg}");
    }
}

#[test]
fn every_truncation_of_a_real_payload_is_an_error_not_a_panic() {
    let full = fixture("observation_two_cameras");
    let mut reader = PickleReader::new(PickleLimits::default());
    for n in 0..full.len() {
        assert!(
            reader.read(&full[..n]).is_err(),
            "prefix of {n} bytes was accepted"
        );
    }
    assert!(reader.read(&full).is_ok());
    let mut trailing = full.clone();
    trailing.push(b'N');
    assert!(matches!(
        reader.read(&trailing),
        Err(PickleError::Trailing(_))
    ));
}

#[test]
fn an_array_whose_shape_disagrees_with_its_bytes_is_refused_with_both_numbers() {
    let mut payload = fixture("observation_p4");
    // The shape tuple (4, 6, 3) as BININT1s then TUPLE3: claim 7 columns.
    let at = payload
        .windows(7)
        .position(|w| w == b"K\x04K\x06K\x03\x87")
        .expect("the shape tuple");
    payload[at + 3] = 7;
    let e = read_observation(&payload).unwrap_err().to_string();
    assert!(e.contains("observation['front']"), "{e}");
    assert!(e.contains("needs 84 bytes, but carries 72"), "{e}");
}

#[test]
fn opcodes_off_the_allow_list_and_deep_nesting_are_refused() {
    let mut reader = PickleReader::new(PickleLimits::default());
    // GLOBAL (text protocol), INST, BINPERSID, NEWOBJ_EX, EXT1, POP, DUP, NEXT_BUFFER.
    for (payload, name) in [
        (&b"\x80\x02cos\nsystem\n."[..], "GLOBAL"),
        (b"\x80\x02(ios\nsystem\n.", "INST"),
        (b"\x80\x02NQ.", "BINPERSID"),
        (b"\x80\x04))}\x92.", "NEWOBJ_EX"),
        (b"\x80\x02\x82\x01.", "EXT1"),
        (b"\x80\x02N0N.", "POP"),
        (b"\x80\x02N2.", "DUP"),
        (b"\x80\x05\x97.", "NEXT_BUFFER"),
    ] {
        let e = reader.read(payload).map(|_| ()).unwrap_err();
        assert!(
            matches!(e, PickleError::Opcode { name: n, .. } if n == name),
            "{name}: {e:?}"
        );
        assert!(e.to_string().contains(name), "{e}");
    }
    let mut deep = b"\x80\x04".to_vec();
    deep.extend(std::iter::repeat_n(b'(', 100_000));
    let e = reader.read(&deep).map(|_| ()).unwrap_err();
    assert!(
        matches!(
            e,
            PickleError::Limit {
                what: "stack depth",
                ..
            }
        ),
        "{e:?}"
    );
    let mut lists = b"\x80\x04".to_vec();
    lists.extend(std::iter::repeat_n(b']', 100_000));
    let e = reader.read(&lists).map(|_| ()).unwrap_err();
    assert!(matches!(e, PickleError::Limit { .. }), "{e:?}");
    // A memo index far past what was stored, and a huge declared string.
    assert!(reader.read(b"\x80\x04j\xff\xff\xff\x7f.").is_err());
    assert!(
        reader
            .read(b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f.")
            .is_err()
    );
    assert!(matches!(
        reader.read(b"\x80\x09N."),
        Err(PickleError::Protocol(9))
    ));
}

#[test]
fn a_payload_that_is_not_a_pickle_is_named() {
    assert!(matches!(lerobot::sniff(b""), Err(LerobotError::Empty)));
    let e = lerobot::sniff(b"\x00\x00\x00\x10{\"type\":...}").unwrap_err();
    assert!(e.to_string().contains("0x00"), "{e}");
}

#[test]
fn the_reply_is_a_protocol_2_list_of_timed_actions_built_with_torch_tensor() {
    let rows: [[f32; 2]; 2] = [[0.5, -1.25], [3.0, 4.5]];
    let bytes: Vec<Vec<u8>> = rows
        .iter()
        .map(|r| r.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let mut buf = Vec::new();
    lerobot::pickled::encode_actions(
        bytes.iter().map(Vec::as_slice),
        policyd::protocol::TimedStep {
            timestep: 40,
            timestamp: 100.0,
        },
        1,
        0.5,
        &mut buf,
    );
    assert_eq!(&buf[..4], b"\x80\x02](");
    assert!(buf.ends_with(b"e."));
    let class = b"clerobot.async_inference.helpers\nTimedAction\n";
    assert_eq!(buf.windows(class.len()).filter(|w| w == class).count(), 2);
    // Step 1 of the chunk is the first sent: timestep 41 at 100.5 s, then 42 at 101.0 s.
    let step = |t: i32| [&b"X\x08\x00\x00\x00timestepJ"[..], &t.to_le_bytes()].concat();
    assert!(buf.windows(18).any(|w| w == step(41).as_slice()));
    assert!(buf.windows(18).any(|w| w == step(42).as_slice()));
    let stamp = [&b"timestampG"[..], &100.5f64.to_be_bytes()].concat();
    assert!(buf.windows(stamp.len()).any(|w| w == stamp.as_slice()));
    let value = [&b"G"[..], &(-1.25f64).to_be_bytes()].concat();
    assert!(buf.windows(9).any(|w| w == value.as_slice()));
}

/// Frames resized as LeRobot 0.6.1's server resizes them: torch's uint8 bilinear kernel on the
/// client's HWC frame, pixel for pixel (cases from tests/fixtures/lerobot/generate.py).
#[test]
fn camera_frames_resize_to_the_same_pixels_as_torch() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/lerobot/resize.json"
    );
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(cases.len(), 4);
    let dims = |v: &serde_json::Value| -> (usize, usize) {
        (
            v[0].as_u64().unwrap() as usize,
            v[1].as_u64().unwrap() as usize,
        )
    };
    let bytes = |v: &serde_json::Value| -> Vec<u8> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u8)
            .collect()
    };
    for case in &cases {
        let (from, to) = (dims(&case["from"]), dims(&case["to"]));
        let (src, want) = (bytes(&case["src"]), bytes(&case["dst"]));
        let mut r = policyd::transform::Resize::new(from, to, 3).unwrap();
        let mut got = vec![0u8; want.len()];
        assert!(r.run(&src, &mut got));
        assert_eq!(got, want, "{from:?} -> {to:?}");
        assert!(!r.run(&src[1..], &mut got), "a short frame is refused");
    }
}

/// lerobot PR #3048's format: a JSON length, the JSON, safetensors. The reply parses back with
/// the safetensors crate into the rows, timesteps and timestamps it was given.
#[test]
fn the_json_safetensors_reply_parses_back_and_observations_read() {
    use policyd::protocol::lerobot::json as lerobot_json;
    let rows: [[f32; 3]; 2] = [[0.5, -1.25, 2.0], [3.0, 4.5, -6.0]];
    let bytes: Vec<Vec<u8>> = rows
        .iter()
        .map(|r| r.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let mut buf = Vec::new();
    lerobot_json::encode_actions(
        bytes.iter().map(Vec::as_slice),
        policyd::protocol::TimedStep {
            timestep: 40,
            timestamp: 100.0,
        },
        1,
        0.5,
        &mut buf,
    );
    let n = u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize;
    let meta: serde_json::Value = serde_json::from_slice(&buf[4..4 + n]).unwrap();
    assert_eq!(meta["type"], "TimedActions");
    assert_eq!(meta["actions"][0]["timestep"], 41);
    assert_eq!(meta["actions"][1]["timestamp"], 101.0);
    let st = safetensors::SafeTensors::deserialize(&buf[4 + n..]).unwrap();
    let a1 = st.tensor("action_1").unwrap();
    assert_eq!(a1.shape(), [3]);
    assert_eq!(a1.data(), bytes[1].as_slice());
    // Told apart from a pickle (PROTO, 0x80) by its first byte: the JSON length's high byte.
    assert_eq!(buf[0], 0);

    // An observation as PR #3048's serialize_observation writes one (built here by hand).
    let json = br#"{"type": "TimedObservation", "timestamp": 1796494091.8933365, "timestep": 3, "must_go": true, "scalar_data": {"gripper.pos": 7.5, "task": "pick"}, "numpy_keys": ["front"]}"#;
    let tensor = br#"{"front":{"dtype":"U8","shape":[2,2,3],"data_offsets":[0,12]}}"#;
    let mut payload = (json.len() as u32).to_be_bytes().to_vec();
    payload.extend_from_slice(json);
    payload.extend_from_slice(&(tensor.len() as u64).to_le_bytes());
    payload.extend_from_slice(tensor);
    payload.extend(0u8..12);
    let obs = lerobot_json::observation(&payload).unwrap();
    // Parsed to the exact double Python's json wrote (serde_json's default parse can be off
    // by one unit in the last place here).
    assert_eq!(
        (obs.timestep, obs.timestamp, obs.must_go),
        (3, 1796494091.8933365, true)
    );
    let entries: Vec<_> = obs.entries().map(Result::unwrap).collect();
    assert_eq!(entries[0], ("gripper.pos", ObsValue::Number(7.5)));
    assert_eq!(entries[1], ("task", ObsValue::Text("pick")));
    match &entries[2] {
        ("front", ObsValue::Array(a)) => {
            assert_eq!(a.shape.as_slice(), [2, 2, 3]);
            assert_eq!(a.data, (0u8..12).collect::<Vec<_>>().as_slice());
        }
        other => panic!("{other:?}"),
    }
    // A wrong type, a JSON length past the end.
    let mut wrong = payload.clone();
    let at = wrong
        .windows(16)
        .position(|w| w == b"TimedObservation")
        .unwrap();
    wrong[at] = b'X';
    let e = lerobot_json::observation(&wrong)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected a TimedObservation"), "{e}");
    let e = lerobot_json::observation(&[0, 0, 1, 0, b'{'])
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("runs past its end"), "{e}");
}

#[test]
fn the_readers_pools_stay_bounded_after_hostile_input() {
    // Five lists of 60,000 memo references each: every list within the per-container cap, the
    // entry pool (kept between messages) past its total cap.
    let mut p = vec![0x80, 4, b'N', 0x94, b']'];
    for _ in 0..5 {
        p.push(b']');
        for _ in 0..60_000 {
            p.extend_from_slice(&[b'h', 0, b'a']);
        }
        p.push(b'a');
    }
    p.push(b'.');
    let mut reader = PickleReader::new(PickleLimits::default());
    let e = reader.read(&p).err().expect("refused");
    assert_eq!(
        e,
        PickleError::Limit {
            what: "items in all containers",
            limit: 262_144
        }
    );
    // A PR #3048 payload whose JSON is declared at 2 MiB is refused before it is parsed.
    let mut json = (2u32 << 20).to_be_bytes().to_vec();
    json.extend(std::iter::repeat_n(b' ', 2 << 20));
    let e = policyd::protocol::lerobot::json::observation(&json)
        .err()
        .expect("refused");
    assert!(e.to_string().contains("at most 1048576"), "{e}");
}
