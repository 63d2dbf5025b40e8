//! What are policyd's fixed caps? Every compile-time bound on a table, buffer or count, in one
//! place, so that each fixed-size structure and each config check agree on its size.

/// Largest array rank accepted on the wire (shapes are held inline at this rank).
pub const MAX_RANK: usize = 8;
/// Most cameras a policy served to LeRobot's `robot_client` may read (an observation's frames
/// are held in a table of this size while it is bound).
pub const MAX_LEROBOT_CAMERAS: usize = 16;
/// Most values one LeRobot observation binds: every camera, the state vector and the task.
pub const MAX_LEROBOT_VALUES: usize = MAX_LEROBOT_CAMERAS + 2;
/// Longest key path (`images/cam_high`) that can name a binding, in bytes.
pub const MAX_PATH: usize = 256;
/// Longest `session_id` accepted, in bytes.
pub const MAX_SESSION_ID: usize = 64;
/// Longest policy name (it travels in paths, requests and messages).
pub const MAX_POLICY_NAME: usize = 64;
/// Largest `tokenizer.max_tokens` (openpi's pi0.5 uses 200).
pub const MAX_TOKENS: usize = 4096;
/// Largest `tokenizer.max_prompt_bytes`: the prompt bytes one request may have tokenized.
pub const MAX_PROMPT_BYTES: usize = 1 << 20;
/// Largest state a pi0.5 prompt carries, in values.
pub const MAX_PROMPT_STATE: usize = 256;
/// Most inputs a pi0.5 tokenizer's `state_key` concatenates into the prompt (openpi's DROID
/// has two: joints and gripper).
pub const MAX_STATE_KEYS: usize = 16;
/// Largest `sampler.max_steps` (DDPM's 1000 training timesteps, one step each).
pub const MAX_SAMPLER_STEPS: usize = 1000;
/// Largest `[[inputs]] history`: frames of one key an engine input holds (LeRobot's
/// `n_obs_steps` is 1 or 2 for its policies).
pub const MAX_HISTORY: usize = 16;
/// Most policies one config may declare.
pub const MAX_POLICIES: usize = 16;
/// Largest `engine.slots` (the scheduler's queue is a fixed array of this size).
pub const MAX_SLOTS: usize = 64;
/// Largest `pacing.latency_window` (the window is a fixed array per session).
pub const MAX_LATENCY_WINDOW: usize = 256;
/// Largest state vector the similarity filter keeps per session.
pub const MAX_SIMILARITY_STATE: usize = 64;
/// Most `session_id`s one connection tracks (`server.max_sessions` is at most this).
pub const MAX_SESSIONS: usize = 64;
/// Timesteps a session remembers having predicted (for `skip_predicted_timesteps`).
pub const PREDICTED_MEMORY: usize = 64;
/// Most handshakes in progress at once, whatever `server.max_connections` is.
pub const MAX_HANDSHAKES: usize = 8192;

/// WebSocket handshakes in progress at once for `max_connections`: room for 16 times the
/// connection limit, so that a burst of clients gets its 503, bounded by [`MAX_HANDSHAKES`].
pub fn handshakes(max_connections: usize) -> usize {
    (max_connections.saturating_mul(16) + 64).min(MAX_HANDSHAKES)
}

/// File descriptors kept for what is not a client's connection: the listeners, epoll and its
/// wakers, timers, the log, the planner's connection, libraries and model files being read.
pub const RESERVED_FDS: usize = 64;
/// Largest HTTP request head accepted.
pub const MAX_HEAD: usize = 8192;
/// The most elements one binding's shape (or `engine_shape`, or a model's declared tensor)
/// may hold: 2^31, 8 GiB as float32, far beyond any observation, and small enough that every
/// buffer size computed from it fits a usize. The config fuzzer found a shape whose product
/// overflowed.
pub const MAX_ELEMENTS: usize = 1 << 31;

/// The number of elements in `shape`, if it is at most [`MAX_ELEMENTS`].
pub fn element_count(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMENTS)
}

/// The frame guard's read buffer under tungstenite, per connection.
pub const FRAME_GUARD_BUFFER: usize = 16 * 1024;
/// What a connection's write buffer may hold beside its largest frame: control frames (a
/// pong, a close: 131 bytes each at most), an error reply and frame headers.
pub const WS_WRITE_SLACK: usize = 64 * 1024;
/// tungstenite's read buffer, allocated per connection (counted in the memory budget).
pub const WS_READ_BUFFER: usize = 128 * 1024;
