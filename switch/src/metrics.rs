//! The metrics endpoint: the switch's counters in Prometheus's text format, served over
//! HTTP at `GET /metrics` (`switch.metrics`), for an operator's monitoring to scrape.
//!
//! Nothing is counted for it: each lane's engine already counts its datagrams and
//! sessions, and a scrape asks every lane for them between two receive calls, as
//! `--stats-interval` does, so the data path takes no lock or atomic per packet. The
//! control plane's census, the resident memory (`/proc/self/statm`) and the uptime are
//! read at the same time. A closed session keeps its series, with its final counts, for
//! [`RETAINED_FOR`] after it closes (at most [`RETAINED_MAX`] sessions), so that a scrape
//! after a job sees how it ended; then they leave, which bounds the labels to the
//! sessions of the last minutes. Switch-wide totals keep every closed session's counts.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use netagg_aggregator::engine::{EngineCounters, SessionCounters};
use netagg_aggregator::faults::FaultCounters;
use netagg_aggregator::SessionId;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::control::ControlPlane;
use crate::datapath::Counters;
use crate::lanes::Lanes;

/// How long a closed session's series stay after it closes.
pub const RETAINED_FOR: Duration = Duration::from_secs(300);
/// Closed sessions whose series stay at most, the latest kept.
pub const RETAINED_MAX: usize = 256;
/// How long a scrape waits for the lanes' counters.
const LANES_WAIT: Duration = Duration::from_secs(2);
/// What `GET /metrics` answers with: the OpenMetrics text format, which Prometheus reads.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A label's value, or a metric's name and help, with where its count is in `C`.
type Labelled<C> = (&'static str, fn(&C) -> u64);
type Described<C> = (&'static str, &'static str, fn(&C) -> u64);

/// A session's counts that are drops, by the `cause` label that names them.
///
/// Every cause of a drop in the data path is here or in [`ENGINE_DROPS`]: a new counter
/// of the engine is one line in one of them.
const SESSION_DROPS: [Labelled<SessionCounters>; 4] = [
    ("stale", |c| c.stale),
    ("stalled", |c| c.stalled),
    ("rejected", |c| c.rejected),
    ("forged", |c| c.forged),
];

/// The drops counted by a lane's engine, before any session is known.
const ENGINE_DROPS: [Labelled<EngineCounters>; 3] =
    [("corrupt", |c| c.corrupt), ("malformed", |c| c.malformed), ("wrong_session", |c| c.unknown_session)];

/// A session's counts that are not drops: name, help and where each is.
const SESSION_COUNTS: [Described<SessionCounters>; 8] = [
    ("packets", "Datagrams that named the session", |c| c.packets_in),
    ("contributions", "Contributions taken into a sum", |c| c.contributions),
    ("results", "Rounds completed, each result sent to every worker", |c| c.results_broadcast),
    ("results_resent", "Results sent again to one worker", |c| c.results_resent),
    ("duplicates", "Duplicate contributions, each answered", |c| c.duplicates),
    ("not_ready", "Requests for a round still aggregating, answered with a pending notice", |c| c.not_ready),
    ("lost_notices", "Notices telling a worker that a contribution it numbered never came", |c| {
        c.lost_notices
    }),
    ("lost_notices_dropped", "Notices of lost contributions not sent, their queue full", |c| {
        c.lost_notices_dropped
    }),
];

/// What fault injection can do to a datagram, by the `fault` label.
const FAULTS: [Labelled<FaultCounters>; 5] = [
    ("drop", |c| c.dropped),
    ("duplicate", |c| c.duplicated),
    ("reorder", |c| c.reordered),
    ("corrupt", |c| c.corrupted),
    ("delay", |c| c.delayed),
];

/// Sessions closed lately, with their final counts, and the counts of every session
/// closed since the switch started.
#[derive(Debug, Default)]
pub struct Retired {
    /// Oldest first.
    recent: VecDeque<(SessionId, Instant, SessionCounters)>,
    totals: SessionCounters,
}

impl Retired {
    /// Notes that `id` closed at `now` with `counters`.
    pub fn retire(&mut self, now: Instant, id: SessionId, counters: SessionCounters) {
        self.totals = self.totals + counters;
        self.recent.push_back((id, now, counters));
        self.prune(now);
    }

    /// Takes `seen`, a session's counters at an earlier scrape, as its final ones if it
    /// closed with fewer packets counted: a session that expired, idle, was closed by
    /// its lane's engine, which keeps no counters of it, and it had no packet since long
    /// before that scrape. So the totals never go down.
    fn settle(&mut self, id: SessionId, seen: SessionCounters) {
        let Some((_, _, counters)) = self.recent.iter_mut().find(|(closed, _, _)| *closed == id) else {
            return;
        };
        if seen.packets_in > counters.packets_in {
            // The totals hold `counters`, so none of its fields exceeds theirs.
            self.totals = self.totals.since(counters) + seen;
            *counters = seen;
        }
    }

    /// Forgets the series of sessions closed more than [`RETAINED_FOR`] before `now`,
    /// and the oldest past [`RETAINED_MAX`].
    fn prune(&mut self, now: Instant) {
        while self.recent.front().is_some_and(|&(_, closed, _)| now.duration_since(closed) > RETAINED_FOR)
            || self.recent.len() > RETAINED_MAX
        {
            self.recent.pop_front();
        }
    }
}

/// What a scrape shows: the data path's and the control plane's figures at one moment.
struct Snapshot {
    /// Each lane's counters, in lane order; empty if a lane did not answer in time.
    lanes: Vec<Counters>,
    /// Per session, open ones first: its counters over every lane, and whether it is open.
    sessions: Vec<(SessionId, SessionCounters, bool)>,
    /// Every session's counts, closed ones included.
    totals: SessionCounters,
    open: usize,
    assembling: usize,
    connections: usize,
    resident_bytes: Option<u64>,
    uptime: Duration,
}

/// Gathers a [`Snapshot`] on each scrape and encodes it.
struct SwitchCollector {
    lanes: Lanes,
    plane: Arc<ControlPlane>,
    started: Instant,
    /// The open sessions of the last scrape, with their counters then.
    seen: Mutex<Vec<(SessionId, SessionCounters)>>,
}

impl fmt::Debug for SwitchCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SwitchCollector").field("started", &self.started).finish_non_exhaustive()
    }
}

impl SwitchCollector {
    /// The counters now; `None` if a lane did not answer within [`LANES_WAIT`], since
    /// figures without its share would look like counters going down.
    fn snapshot(&self) -> Option<Snapshot> {
        let lanes = self.lanes.lane_counters(LANES_WAIT)?;
        let census = self.plane.census();
        // Read after the lanes, so that a session closed in between counts once, as closed.
        let mut retired = self.lanes.retired();
        let mut open: Vec<(SessionId, SessionCounters)> = Vec::new();
        for (id, counters) in lanes.iter().flat_map(|lane| &lane.sessions) {
            match open.iter_mut().find(|(open_id, _)| open_id == id) {
                Some((_, total)) => *total = *total + *counters,
                None => open.push((*id, *counters)),
            }
        }
        open.retain(|(id, _)| !retired.recent.iter().any(|(closed, _, _)| closed == id));
        let mut seen = self.seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (id, counters) in seen.drain(..) {
            retired.settle(id, counters);
        }
        seen.extend(open.iter().copied());
        drop(seen);
        let totals = open.iter().fold(retired.totals, |sum, (_, counters)| sum + *counters);
        let sessions = open
            .into_iter()
            .map(|(id, counters)| (id, counters, true))
            .chain(retired.recent.iter().map(|&(id, _, counters)| (id, counters, false)))
            .collect();
        drop(retired);
        Some(Snapshot {
            lanes,
            sessions,
            totals,
            open: census.open,
            assembling: census.assembling,
            connections: census.connections,
            resident_bytes: resident_bytes(Path::new("/proc/self")).ok(),
            uptime: self.started.elapsed(),
        })
    }
}

impl Collector for SwitchCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        // The scrape fails (503) rather than publish partial totals.
        let snapshot = self.snapshot().ok_or(fmt::Error)?;
        let mut out = Out(&mut encoder);

        out.gauge(
            "netagg_switch_uptime_seconds",
            "Seconds since the switch started",
            snapshot.uptime.as_secs_f64(),
        )?;
        if let Some(bytes) = snapshot.resident_bytes {
            out.gauge(
                "process_resident_memory_bytes",
                "Resident memory of the switch process",
                bytes as i64,
            )?;
        }
        let states = [("open", snapshot.open), ("assembling", snapshot.assembling)];
        out.family(
            "netagg_switch_sessions",
            "Sessions open, and assembling (registering or opening)",
            Kind::Gauge,
            states.iter().map(|&(state, count)| (vec![("state", state.to_string())], count as u64)),
        )?;
        out.gauge(
            "netagg_switch_control_connections",
            "Control connections of workers, registered or registering",
            snapshot.connections as i64,
        )?;

        let lanes = || snapshot.lanes.iter().enumerate();
        let by_lane = |field: fn(&EngineCounters) -> u64| {
            lanes().map(move |(index, lane)| (vec![("lane", index.to_string())], field(&lane.engine)))
        };
        out.family(
            "netagg_switch_datagrams",
            "Datagrams received, by lane",
            Kind::Counter,
            by_lane(|c| c.datagrams),
        )?;
        // Every lane opens and closes every session: the first lane counts each once.
        let first = snapshot.lanes.first().map(|lane| lane.engine);
        let session_events: [Described<EngineCounters>; 3] = [
            ("netagg_switch_sessions_opened", "Sessions opened", |c| c.sessions_opened),
            ("netagg_switch_sessions_closed", "Sessions closed", |c| c.sessions_closed),
            ("netagg_switch_sessions_expired", "Sessions closed for want of packets", |c| c.sessions_expired),
        ];
        for (name, help, field) in session_events {
            if let Some(engine) = &first {
                out.counter(name, help, field(engine))?;
            }
        }

        let engine_drops = ENGINE_DROPS.iter().flat_map(|&(cause, field)| {
            lanes().map(move |(index, lane)| (cause, index.to_string(), field(&lane.engine)))
        });
        let session_drops =
            SESSION_DROPS.iter().map(|&(cause, field)| (cause, "all".to_string(), field(&snapshot.totals)));
        out.family(
            "netagg_switch_dropped",
            "Datagrams dropped, by cause and lane (a session's causes over all lanes: lane=\"all\")",
            Kind::Counter,
            engine_drops
                .chain(session_drops)
                .map(|(cause, lane, count)| (vec![("cause", cause.to_string()), ("lane", lane)], count)),
        )?;

        for (name, help, field) in SESSION_COUNTS {
            out.counter(
                &format!("netagg_switch_{name}"),
                &format!("{help}, every session"),
                field(&snapshot.totals),
            )?;
        }
        let session = |id: SessionId| ("session", format!("{:#010x}", id.0));
        out.family(
            "netagg_switch_session_open",
            "1 while the session is open; 0 for a while after it closed",
            Kind::Gauge,
            snapshot.sessions.iter().map(|&(id, _, open)| (vec![session(id)], u64::from(open))),
        )?;
        for (name, help, field) in SESSION_COUNTS {
            out.family(
                &format!("netagg_switch_session_{name}"),
                &format!("{help}, by session"),
                Kind::Counter,
                snapshot.sessions.iter().map(|(id, counters, _)| (vec![session(*id)], field(counters))),
            )?;
        }
        out.family(
            "netagg_switch_session_dropped",
            "Datagrams of a session dropped, by cause",
            Kind::Counter,
            snapshot.sessions.iter().flat_map(|(id, counters, _)| {
                SESSION_DROPS.iter().map(move |&(cause, field)| {
                    (vec![session(*id), ("cause", cause.to_string())], field(counters))
                })
            }),
        )?;

        let faults: Vec<(&str, FaultCounters)> = snapshot
            .lanes
            .iter()
            .filter_map(|lane| lane.faults)
            .flat_map(|(receive, send)| [("receive", receive), ("send", send)])
            .collect();
        if !faults.is_empty() {
            out.family(
                "netagg_switch_faults_injected",
                "Faults injected into the data path (switch.faults), by direction and fault",
                Kind::Counter,
                ["receive", "send"].into_iter().flat_map(|direction| {
                    let faults = &faults;
                    FAULTS.iter().map(move |&(fault, field)| {
                        let count =
                            faults.iter().filter(|(d, _)| *d == direction).map(|(_, c)| field(c)).sum();
                        (vec![("direction", direction.to_string()), ("fault", fault.to_string())], count)
                    })
                }),
            )?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
}

/// The encoder, with what this module writes: unlabelled metrics and families of
/// integer samples.
struct Out<'a, 'b>(&'a mut DescriptorEncoder<'b>);

impl Out<'_, '_> {
    fn counter(&mut self, name: &str, help: &str, value: u64) -> Result<(), fmt::Error> {
        let counter = ConstCounter::new(value);
        counter.encode(self.0.encode_descriptor(name, help, None, counter.metric_type())?)
    }

    fn gauge<N>(&mut self, name: &str, help: &str, value: N) -> Result<(), fmt::Error>
    where
        ConstGauge<N>: EncodeMetric,
    {
        let gauge = ConstGauge::new(value);
        gauge.encode(self.0.encode_descriptor(name, help, None, gauge.metric_type())?)
    }

    fn family(
        &mut self,
        name: &str,
        help: &str,
        kind: Kind,
        samples: impl Iterator<Item = (Vec<(&'static str, String)>, u64)>,
    ) -> Result<(), fmt::Error> {
        let metric_type = match kind {
            Kind::Counter => ConstCounter::new(0u64).metric_type(),
            Kind::Gauge => ConstGauge::new(0i64).metric_type(),
        };
        let mut family = self.0.encode_descriptor(name, help, None, metric_type)?;
        for (labels, value) in samples {
            let sample = family.encode_family(&labels)?;
            match kind {
                Kind::Counter => ConstCounter::new(value).encode(sample)?,
                Kind::Gauge => ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(sample)?,
            }
        }
        Ok(())
    }
}

/// The resident memory of a process in bytes, from `PROCESS/statm` (`/proc/self`,
/// `/proc/1234`): its second field, in pages.
pub fn resident_bytes(process: &Path) -> io::Result<u64> {
    let path = process.join("statm");
    let statm = std::fs::read_to_string(&path)
        .map_err(|error| io::Error::new(error.kind(), format!("{}: {error}", path.display())))?;
    let pages = statm.split_whitespace().nth(1).and_then(|field| field.parse::<u64>().ok());
    let pages = pages.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: no resident page count in '{statm}'", path.display()),
        )
    })?;
    Ok(pages * rustix::param::page_size() as u64)
}

/// The HTTP server of the metrics endpoint and its thread; dropping it stops both.
pub struct MetricsServer {
    address: SocketAddr,
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens at `address` (port 0 picks a free one) and answers scrapes with the
    /// figures of `lanes` and `plane` until dropped.
    pub fn start(address: SocketAddr, lanes: Lanes, plane: Arc<ControlPlane>) -> io::Result<MetricsServer> {
        let server = tiny_http::Server::http(address).map_err(io::Error::other)?;
        let bound = server.server_addr().to_ip().unwrap_or(address);
        let server = Arc::new(server);
        let mut registry = Registry::default();
        let collector = SwitchCollector { lanes, plane, started: Instant::now(), seen: Mutex::default() };
        registry.register_collector(Box::new(collector));
        let serving = Arc::clone(&server);
        let thread =
            std::thread::Builder::new().name("metrics".into()).spawn(move || serve(&serving, &registry))?;
        Ok(MetricsServer { address: bound, server, thread: Some(thread) })
    }

    /// Where the endpoint listens, with the port actually bound.
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Answers requests until the server is unblocked: the metrics at `GET /metrics`, 404
/// elsewhere, 405 for another method.
fn serve(server: &tiny_http::Server, registry: &Registry) {
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or_default();
        let response = if path != "/metrics" {
            tiny_http::Response::from_string("not found: the metrics are at /metrics\n").with_status_code(404)
        } else if *request.method() != tiny_http::Method::Get {
            tiny_http::Response::from_string("only GET serves /metrics\n").with_status_code(405)
        } else {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, registry) {
                Ok(()) => {
                    // The header's name and value are constants that parse.
                    let header =
                        tiny_http::Header::from_bytes("Content-Type", CONTENT_TYPE).expect("a valid header");
                    tiny_http::Response::from_string(text).with_header(header)
                }
                Err(_) => tiny_http::Response::from_string(format!(
                    "a data-path thread did not give its counters within {LANES_WAIT:?}\n"
                ))
                .with_status_code(503),
            }
        };
        if let Err(error) = request.respond(response) {
            tracing::debug!(%error, "cannot answer a metrics request");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closed_sessions_keep_their_series_for_a_while_and_their_counts_for_ever() {
        let start = Instant::now();
        let mut retired = Retired::default();
        let counters = |packets_in| SessionCounters { packets_in, ..Default::default() };
        retired.retire(start, SessionId(1), counters(10));
        retired.retire(start + Duration::from_secs(10), SessionId(2), counters(5));
        assert_eq!(retired.recent.iter().map(|(id, _, _)| id.0).collect::<Vec<_>>(), [1, 2]);
        // The first is past its time when a third closes; the second is not.
        retired.retire(start + RETAINED_FOR + Duration::from_secs(1), SessionId(3), counters(1));
        assert_eq!(retired.recent.iter().map(|(id, _, _)| id.0).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(retired.totals.packets_in, 16);
        // Many closing at once keep only the latest.
        for id in 10..10 + RETAINED_MAX as u32 + 5 {
            retired.retire(start + RETAINED_FOR + Duration::from_secs(2), SessionId(id), counters(1));
        }
        assert_eq!(retired.recent.len(), RETAINED_MAX);
        assert_eq!(retired.recent.front().map(|(id, _, _)| id.0), Some(15));
    }

    #[test]
    fn a_session_closed_without_its_counters_keeps_those_of_the_last_scrape() {
        let now = Instant::now();
        let counters = |packets_in| SessionCounters { packets_in, ..Default::default() };
        let mut retired = Retired::default();
        retired.retire(now, SessionId(1), counters(10));
        // Expired: its engine kept nothing, the lanes' close found nothing.
        retired.retire(now, SessionId(2), SessionCounters::default());
        retired.settle(SessionId(2), counters(7));
        // Closed with its counters, later than the last scrape's: those stay.
        retired.settle(SessionId(1), counters(4));
        let kept: Vec<u64> = retired.recent.iter().map(|(_, _, c)| c.packets_in).collect();
        assert_eq!(kept, [10, 7]);
        assert_eq!(retired.totals.packets_in, 17);
    }

    #[test]
    fn resident_memory_is_read_from_statm_and_a_missing_process_is_an_error_naming_it() {
        let bytes = resident_bytes(Path::new("/proc/self")).unwrap();
        assert!(bytes > 100 << 10 && bytes < 100 << 30, "{bytes}");
        let error = resident_bytes(Path::new("/proc/no-such-process")).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::NotFound);
        assert!(error.to_string().starts_with("/proc/no-such-process/statm: "), "{error}");
    }
}
