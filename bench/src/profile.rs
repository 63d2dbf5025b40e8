//! What a benchmark request carries: the observation arrays of a profile, encoded ahead of time.
//!
//! Frames are encoded before the clock starts so the load generator's own cost stays out of
//! the numbers. Image bytes are random (never zeros: an all-zero frame can hide a server that
//! skips work), and every request gets its sequence number stamped into each array, so no two
//! requests carry the same content even though a connection cycles through a small pool.

use bytes::Bytes;

use policyd::config::PolicySpec;
use policyd::dtype::ElemType;
use policyd::protocol::Encoder;

/// One array of an observation.
#[derive(Clone, Debug, PartialEq)]
pub struct ArraySpec {
    /// Key path: one element is a top-level key (which may itself contain `/`, as openpi's
    /// DROID and LIBERO keys do); two nest a map (`["images", "cam_high"]`, as ALOHA does).
    pub path: Vec<String>,
    pub dtype: ElemType,
    pub shape: Vec<usize>,
}

/// An observation shape: the arrays and the prompt a request carries.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub name: String,
    pub arrays: Vec<ArraySpec>,
    /// Sent as a string under this key (openpi's `prompt`), when set.
    pub prompt: Option<(String, String)>,
}

/// The built-in profile names.
pub const BUILT_IN: [&str; 6] = ["aloha", "droid", "libero", "tiny", "flow", "diffusion"];

fn spec(path: &[&str], dtype: ElemType, shape: &[usize]) -> ArraySpec {
    ArraySpec {
        path: path.iter().map(|s| s.to_string()).collect(),
        dtype,
        shape: shape.to_vec(),
    }
}

impl Profile {
    /// A built-in profile, as openpi's examples send it: ALOHA (four CHW cameras, state [14]),
    /// DROID (two HWC cameras, joints [7], gripper [1]), LIBERO (two HWC cameras, state [8]),
    /// `tiny` (state [8] only: what the transport and the server cost with almost no data), and
    /// the two demo pipelines, `flow` and `diffusion`.
    pub fn built_in(name: &str) -> Option<Profile> {
        use ElemType::{F32, F64, U8};
        let img_chw = [3, 224, 224];
        let img_hwc = [224, 224, 3];
        let arrays = match name {
            "aloha" => {
                let mut v: Vec<ArraySpec> =
                    ["cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"]
                        .iter()
                        .map(|c| spec(&["images", c], U8, &img_chw))
                        .collect();
                v.push(spec(&["state"], F64, &[14]));
                v
            }
            "droid" => vec![
                spec(&["observation/exterior_image_1_left"], U8, &img_hwc),
                spec(&["observation/wrist_image_left"], U8, &img_hwc),
                spec(&["observation/joint_position"], F64, &[7]),
                spec(&["observation/gripper_position"], F64, &[1]),
            ],
            "libero" => vec![
                spec(&["observation/image"], U8, &img_hwc),
                spec(&["observation/wrist_image"], U8, &img_hwc),
                spec(&["observation/state"], F32, &[8]),
            ],
            "tiny" => vec![spec(&["observation/state"], F32, &[8])],
            // configs/flow.toml (pi0-shaped pipeline): three HWC cameras, state [32], a prompt.
            "flow" => {
                let mut v: Vec<ArraySpec> = ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"]
                    .iter()
                    .map(|c| spec(&["images", c], U8, &img_hwc))
                    .collect();
                v.push(spec(&["state"], F32, &[32]));
                v
            }
            // configs/diffusion.toml (LeRobot PushT-shaped): 2 steps of state [2] and a 96×96
            // image.
            "diffusion" => vec![
                spec(&["observation/state"], F32, &[2, 2]),
                spec(&["observation/image"], U8, &[2, 96, 96, 3]),
            ],
            _ => return None,
        };
        Some(Profile {
            name: name.to_string(),
            arrays,
            prompt: Some(("prompt".into(), "pick up the cup".into())),
        })
    }

    /// The observation a policyd config's `[[inputs]]` expect: each key with its first accepted
    /// dtype and its wire shape; a `text` binding carries the prompt.
    pub fn from_config(name: &str, policy: &PolicySpec) -> Result<Profile, String> {
        let mut arrays = Vec::new();
        let mut prompt = None;
        for b in &policy.inputs {
            if b.is_text() {
                prompt = Some((b.key.clone(), "pick up the cup".to_string()));
                continue;
            }
            let &dtype = b
                .dtypes()
                .first()
                .ok_or_else(|| format!("inputs '{}': no dtype", b.key))?;
            arrays.push(ArraySpec {
                path: vec![b.key.clone()],
                dtype,
                shape: b.shape.clone(),
            });
        }
        Ok(Profile {
            name: name.to_string(),
            arrays,
            prompt: prompt.or_else(|| Some(("prompt".into(), "pick up the cup".into()))),
        })
    }

    /// Encodes one request (openpi numpy markers) filled from `seed`; also returns where each
    /// array's data starts, for [`FramePool`]'s per-request stamp.
    pub fn encode(&self, seed: u64) -> (Vec<u8>, Vec<usize>) {
        let mut buf = Vec::new();
        let mut stamps = Vec::new();
        let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        // Top-level entries in first-seen order, each with the arrays under it.
        let mut tops: Vec<(&str, Vec<&ArraySpec>)> = Vec::new();
        for a in &self.arrays {
            let top = a.path[0].as_str();
            match tops.iter_mut().find(|(t, _)| *t == top) {
                Some((_, v)) => v.push(a),
                None => tops.push((top, vec![a])),
            }
        }
        let mut e = Encoder { buf: &mut buf };
        e.map(tops.len() as u32 + u32::from(self.prompt.is_some()));
        let mut array = |e: &mut Encoder<'_>, a: &ArraySpec, stamps: &mut Vec<usize>| {
            let n = a.shape.iter().product::<usize>();
            let len = n * a.dtype.size();
            let before = e.buf.len();
            e.ndarray(a.dtype, &a.shape, len, |d| fill(a.dtype, d, &mut rng));
            // The data follows the marker's map header (1), `__ndarray__` (13), `true` (1),
            // `data` (6) and the bin header (the unit test decodes the frame to check this).
            let data_start = before + 1 + 13 + 1 + 6 + bin_header(len);
            if a.dtype == ElemType::U8 && len >= 8 {
                stamps.push(data_start);
            }
        };
        for (top, arrays) in &tops {
            e.str(top);
            if arrays.len() == 1 && arrays[0].path.len() == 1 {
                array(&mut e, arrays[0], &mut stamps);
            } else {
                e.map(arrays.len() as u32);
                for a in arrays {
                    e.str(a.path.get(1).map(String::as_str).unwrap_or(""));
                    array(&mut e, a, &mut stamps);
                }
            }
        }
        if let Some((k, v)) = &self.prompt {
            e.str(k);
            e.str(v);
        }
        (buf, stamps)
    }

    /// One line describing the arrays, for the report.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .arrays
            .iter()
            .map(|a| format!("{} {}{:?}", a.path.join("/"), a.dtype.name(), a.shape))
            .collect();
        parts.join(", ")
    }
}

/// Size of a msgpack bin header for `len` bytes.
fn bin_header(len: usize) -> usize {
    if len < 256 {
        2
    } else if len < 65536 {
        3
    } else {
        5
    }
}

/// Random element values: uint8 images get every byte value but zero, floats get values in
/// [-1, 1) (a joint state, not NaN bit patterns), integers small values.
fn fill(dtype: ElemType, d: &mut [u8], rng: &mut u64) {
    let mut next = || {
        // xorshift64*: fast, and good enough for image noise.
        *rng ^= *rng >> 12;
        *rng ^= *rng << 25;
        *rng ^= *rng >> 27;
        rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    match dtype {
        ElemType::F32 => {
            for c in d.chunks_exact_mut(4) {
                let v = (next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        ElemType::F64 => {
            for c in d.chunks_exact_mut(8) {
                let v = (next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        _ => {
            for c in d.chunks_mut(8) {
                let r = next().to_le_bytes();
                for (x, y) in c.iter_mut().zip(r) {
                    *x = if dtype == ElemType::U8 {
                        y.max(1)
                    } else {
                        y & 0x3f
                    };
                }
            }
        }
    }
}

/// A connection's requests: a few distinct pre-encoded frames, cycled, each stamped with the
/// request number before it is sent so that every request differs.
pub struct FramePool {
    frames: Vec<(Vec<u8>, Vec<usize>)>,
}

impl FramePool {
    /// `count` distinct frames for the connection numbered `conn`.
    pub fn new(profile: &Profile, conn: u64, count: usize) -> FramePool {
        let frames = (0..count.max(1) as u64)
            .map(|i| profile.encode(conn.wrapping_mul(1_000_003).wrapping_add(i + 1)))
            .collect();
        FramePool { frames }
    }

    /// The frame for request `k` (copied, so the send owns it; done outside the timed span).
    pub fn request(&mut self, k: u64) -> Bytes {
        let n = self.frames.len();
        let (frame, stamps) = &mut self.frames[(k as usize) % n];
        let stamp = (k + 1).to_le_bytes().map(|b| b.max(1));
        for &s in stamps.iter() {
            frame[s..s + 8].copy_from_slice(&stamp);
        }
        Bytes::copy_from_slice(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'v>(m: &'v rmpv::Value, k: &str) -> &'v rmpv::Value {
        m.as_map()
            .and_then(|m| {
                m.iter()
                    .find(|(mk, _)| mk.as_str() == Some(k) || mk.as_slice() == Some(k.as_bytes()))
            })
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no key {k} in {m}"))
    }

    #[test]
    fn built_in_profiles_encode_as_openpi_sends_them() {
        let aloha = Profile::built_in("aloha").unwrap();
        let (f, stamps) = aloha.encode(7);
        let v = rmpv::decode::read_value(&mut &f[..]).unwrap();
        let cam = get(get(&v, "images"), "cam_high");
        assert_eq!(get(cam, "dtype").as_str(), Some("|u1"));
        assert_eq!(get(cam, "shape").to_string(), "[3, 224, 224]");
        let data = get(cam, "data").as_slice().unwrap();
        assert_eq!(data.len(), 3 * 224 * 224);
        assert!(!data.contains(&0), "image bytes are never zero");
        assert_eq!(get(get(&v, "state"), "dtype").as_str(), Some("<f8"));
        assert_eq!(get(&v, "prompt").as_str(), Some("pick up the cup"));
        assert_eq!(stamps.len(), 4, "one stamp per camera");

        let droid = Profile::built_in("droid").unwrap();
        let v = rmpv::decode::read_value(&mut &droid.encode(1).0[..]).unwrap();
        get(&v, "observation/exterior_image_1_left");
        assert_eq!(
            get(get(&v, "observation/joint_position"), "shape").to_string(),
            "[7]"
        );
        assert!(Profile::built_in("tiny").unwrap().encode(1).0.len() < 200);
        assert!(Profile::built_in("franka").is_none());
    }

    #[test]
    fn every_request_differs_and_the_stamp_lands_in_image_data() {
        let p = Profile::built_in("libero").unwrap();
        let mut pool = FramePool::new(&p, 3, 2);
        let frames: Vec<Bytes> = (0..4).map(|k| pool.request(k)).collect();
        for (i, a) in frames.iter().enumerate() {
            // Still a valid observation, the stamp inside the image bytes.
            let v = rmpv::decode::read_value(&mut &a[..]).unwrap();
            let img = get(get(&v, "observation/image"), "data")
                .as_slice()
                .unwrap();
            assert_eq!(&img[..8], &(i as u64 + 1).to_le_bytes().map(|b| b.max(1)));
            for b in &frames[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // Different connections start from different content.
        let mut other = FramePool::new(&p, 4, 2);
        assert_ne!(other.request(0), FramePool::new(&p, 3, 2).request(0));
    }

    #[test]
    fn a_config_profile_sends_each_binding_with_its_first_dtype() {
        let cfg = policyd::config::Config::parse(
            "[engine]\nmodel = \"synthetic\"\n\
             [[inputs]]\nkey = \"images/top\"\ntensor = \"a\"\ndtypes = [\"uint8\"]\nshape = [4, 4, 3]\n\
             [[inputs]]\nkey = \"joints\"\ntensor = \"b\"\ndtypes = [\"float32\", \"float64\"]\nshape = [6]\n\
             [[inputs]]\nkey = \"task\"\ntensor = \"c\"\ndtypes = [\"text\"]\nshape = [32]\n\
             [[outputs]]\ntensor = \"actions\"\n",
            "test",
            None,
        )
        .unwrap();
        let p = Profile::from_config("config", cfg.default_policy()).unwrap();
        assert_eq!(p.arrays.len(), 2);
        assert_eq!(p.arrays[1].dtype, ElemType::F32);
        assert_eq!(p.prompt.as_ref().map(|(k, _)| k.as_str()), Some("task"));
        let v = rmpv::decode::read_value(&mut &p.encode(1).0[..]).unwrap();
        assert_eq!(get(get(&v, "images/top"), "shape").to_string(), "[4, 4, 3]");
        assert!(get(&v, "task").is_str());
    }
}
