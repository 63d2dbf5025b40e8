use super::*;
use std::sync::atomic::Ordering;

use crate::config::Config;
use crate::dtype::ElemType;
use crate::engine::{IoSpec, TensorSpec};
use crate::protocol::dialect::ResetScope;
use crate::protocol::{Endpoint, RequestMeta};
use crate::testing::synthetic::{Behaviour, SyntheticEngine};

fn served(pacing: &str) -> (Context, Arc<Policy>) {
    served_with(pacing, watch::channel(0).1)
}

fn served_with(pacing: &str, generation: watch::Receiver<u64>) -> (Context, Arc<Policy>) {
    let text = format!(
        "[server]\nhost = \"127.0.0.1\"\nport = 0\n\
         [engine]\nmodel = \"synthetic\"\nwarmup_runs = 0\nslots = 4\n\
         [pacing]\n{pacing}\n\
         [[inputs]]\nkey = \"state\"\ntensor = \"state\"\ndtypes = [\"float32\"]\nshape = [2]\n\
         [[outputs]]\ntensor = \"actions\"\n"
    );
    let cfg = Config::parse(&text, "test", None).expect("config");
    let io = IoSpec {
        inputs: vec![TensorSpec {
            name: "state".into(),
            dtype: ElemType::F32,
            shape: vec![1, 2],
        }],
        outputs: vec![TensorSpec {
            name: "actions".into(),
            dtype: ElemType::F32,
            shape: vec![1, 4, 2],
        }],
    };
    let engine = Box::new(SyntheticEngine::new(io, Behaviour::default()));
    let spec = cfg.default_policy().clone();
    let loaded = crate::policy::build::load_engine(&cfg, &spec, engine).expect("loads");
    let stats = loaded.stats.clone();
    let set = crate::policy::PolicySet::single(Policy::new(&cfg, spec, loaded));
    let policy = set.default_policy().clone();
    let cx = Context {
        stats,
        pacer: Arc::new(Pacer::start(Duration::ZERO).expect("pacer")),
        planner: None,
        max_sessions: 4,
        generation,
        policies: Arc::new(arc_swap::ArcSwap::from_pointee(set)),
    };
    (cx, policy)
}

/// Starts a request whose state is `[x, 0]`, as a front end's decoder would write it.
fn start(core: &mut Core, endpoint: Endpoint, x: f32, timestep: i64) -> Started {
    let lease = core
        .policy()
        .worker
        .pool
        .try_acquire()
        .expect("a free slot");
    core.start(
        Instant::now(),
        lease,
        ResetScope::Session,
        |_, inputs, seen, _| {
            let b = inputs[0].bytes_mut();
            b[..4].copy_from_slice(&x.to_le_bytes());
            b[4..8].fill(0);
            seen[0] = true;
            Ok(RequestMeta {
                endpoint,
                timestep: Some(timestep),
                timestamp: Some(timestep as f64 / 10.0),
                ..RequestMeta::default()
            })
        },
    )
}

/// Waits for the core's next event, releases its result, and returns the reply's first
/// action value.
async fn reply(core: &mut Core) -> (Kind, f32) {
    let event = tokio::time::timeout(Duration::from_secs(10), core.next())
        .await
        .expect("the engine's reply within 10 s");
    let Event::Release { lease, .. } = event else {
        panic!("a result to release");
    };
    let mut got = None;
    drop(core.release(lease, false, |r| {
        let (rows, _) = r.reply.rows_f32(0, usize::MAX).expect("f32 rows");
        let first = f32::from_le_bytes(rows[..4].try_into().expect("4 bytes"));
        got = Some((r.kind, first));
    }));
    got.expect("encoded")
}

#[tokio::test]
async fn an_infer_request_runs_and_is_released() {
    let (cx, policy) = served("");
    let mut core = Core::new(&cx, policy, 1, Route::Openpi, Precision::Float32);
    assert!(matches!(
        start(&mut core, Endpoint::Infer, 3.0, 0),
        Started::Queued
    ));
    assert!(core.infer_busy() && !core.idle());
    assert_eq!(reply(&mut core).await, (Kind::Infer, 3.0));
    assert!(core.idle() && !core.infer_busy());
    core.close();
}

#[tokio::test]
async fn observations_run_once_per_timestep() {
    let (cx, policy) = served("");
    let mut core = Core::new(&cx, policy, 1, Route::Openpi, Precision::Float32);
    assert!(matches!(
        start(&mut core, Endpoint::Observe, 1.0, 0),
        Started::Queued
    ));
    assert_eq!(reply(&mut core).await, (Kind::Observe, 1.0));
    // The same timestep again: predicted already, never queued.
    assert!(matches!(
        start(&mut core, Endpoint::Observe, 9.0, 0),
        Started::Skipped {
            why: SkipReason::AlreadyPredicted,
            ..
        }
    ));
    assert!(core.idle());
    assert!(matches!(
        start(&mut core, Endpoint::Observe, 5.0, 10),
        Started::Queued
    ));
    assert_eq!(reply(&mut core).await, (Kind::Observe, 5.0));
    assert_eq!(cx.stats.skips.observed.load(Ordering::Relaxed), 3);
    assert_eq!(cx.stats.skips.already_predicted.load(Ordering::Relaxed), 1);
    core.close();
}

#[tokio::test]
async fn a_reload_is_an_event_and_the_server_going_is_not() {
    let (tx, rx) = watch::channel(0);
    let (cx, policy) = served_with("", rx);
    let mut core = Core::new(&cx, policy, 1, Route::Openpi, Precision::Float32);
    // A reload that kept the policy's engine is nothing to this client.
    tx.send_replace(1);
    let kept = tokio::time::timeout(Duration::from_millis(50), core.next()).await;
    assert!(kept.is_err(), "no event for an unchanged policy");
    // One that replaced it is, naming the new one; the core asked again says the same.
    let (_, other) = served_with("", watch::channel(0).1);
    let set = |policies| crate::policy::PolicySet {
        policies,
        default: 0,
        generation: 2,
        budget: 0,
    };
    cx.policies.store(Arc::new(set(vec![other.clone()])));
    tx.send_replace(2);
    let event = tokio::time::timeout(Duration::from_secs(5), core.next()).await;
    assert!(
        matches!(&event, Ok(Event::Reloaded(Reload::Replaced(p))) if Arc::ptr_eq(p, &other)),
        "replaced"
    );
    assert!(matches!(core.reload(), Some(Reload::Replaced(_))));
    // Gone from the set: removed.
    cx.policies.store(Arc::new(set(Vec::new())));
    assert!(matches!(core.reload(), Some(Reload::Removed)));
    // The generation's sender gone: next() waits (for requests), it does not spin.
    drop(tx);
    let waited = tokio::time::timeout(Duration::from_millis(50), core.next()).await;
    assert!(waited.is_err(), "nothing to wait for");
    assert!(matches!(
        start(&mut core, Endpoint::Infer, 2.0, 0),
        Started::Queued
    ));
    assert_eq!(reply(&mut core).await, (Kind::Infer, 2.0));
    core.close();
}
