//! The strict pickle reader and the lowering of LeRobot's payloads (the gRPC service's input).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| policyd::testing::fuzz::pickle(data));
