//! The wire formats and bindings without a server, in one test binary: the msgpack decoder's
//! properties and the fuzz corpora replayed, LeRobot's pickles and JSON payloads, and the
//! bindings LeRobot policies need.

#[path = "../common/mod.rs"]
mod common;

mod codec_props;
mod lerobot_bindings;
mod lerobot_codec;
