//! The control plane's handle on the data path's lanes: it opens, closes and parts
//! sessions in every lane's engine, and adds up their counters.
//!
//! A session opens in the first lane, whose engine chooses its id, then in the others
//! under that id, so that every packet's session id is valid in whichever lane owns its
//! slot; if any lane refuses, the lanes that opened it close it again. A session ends in
//! all lanes together: closed, expired or orphaned in one, it is closed in the rest.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use netagg_aggregator::control::{OpenError, Registered};
use netagg_aggregator::engine::SessionCounters;
use netagg_aggregator::faults::FaultCounters;
use netagg_aggregator::{Departure, SessionId, SessionSpec};
use rustc_hash::FxHashMap;

use crate::datapath::{Activity, Command, Counters, UpstreamPath};
use crate::metrics::Retired;

/// How long a lane has to answer a request of the control plane.
const LANE_WAIT: Duration = Duration::from_secs(5);

/// Senders to every lane's command channel, in lane order.
#[derive(Clone)]
pub struct Lanes {
    commands: Vec<Sender<Command>>,
    activity: Activity,
    /// The final counts of sessions closed, for the metrics.
    retired: Arc<Mutex<Retired>>,
}

impl Lanes {
    pub fn new(commands: Vec<Sender<Command>>, activity: Activity) -> Lanes {
        Lanes { commands, activity, retired: Arc::default() }
    }

    /// Opens a session in every lane under one id.
    pub fn open(
        &self,
        spec: SessionSpec,
        token: u64,
        workers: Vec<Registered>,
        upstream: Option<UpstreamPath>,
    ) -> Result<SessionId, OpenError> {
        let Some((first, others)) = self.commands.split_first() else { return Err(OpenError::Unanswered) };
        let open = |id, reply| Command::Open {
            id,
            spec,
            token,
            workers: workers.clone(),
            upstream: upstream.clone(),
            reply,
        };
        let id = ask(first, |reply| open(None, reply)).unwrap_or(Err(OpenError::Unanswered))?;
        // The other lanes open it at once, each between two of its receive calls.
        let answers: Vec<_> = others.iter().map(|lane| send(lane, |reply| open(Some(id), reply))).collect();
        let refusal = answers
            .into_iter()
            .map(|answer| answer.and_then(|answer| answer.recv_timeout(LANE_WAIT).ok()))
            .find_map(|opened| match opened {
                Some(Ok(_)) => None,
                Some(Err(error)) => Some(error),
                None => Some(OpenError::Unanswered),
            });
        match refusal {
            None => {
                self.activity().insert(id, Instant::now());
                Ok(id)
            }
            Some(error) => {
                self.close(id);
                Err(error)
            }
        }
    }

    /// Closes a session in every lane that holds it; its final counters, added up over
    /// the lanes, if any held it.
    pub fn close(&self, id: SessionId) -> Option<SessionCounters> {
        self.close_orphaned(id, None)
    }

    /// [`Lanes::close`] for a session one lane has closed already, with `closed` its
    /// counters there; the counters over every lane.
    pub fn close_orphaned(&self, id: SessionId, closed: Option<SessionCounters>) -> Option<SessionCounters> {
        let others = self.ask_all(|reply| Command::Close { id, reply });
        self.activity().remove(&id);
        let counters = others.into_iter().flatten().flatten().chain(closed).reduce(|sum, lane| sum + lane);
        // Without counters too (an expired session's engine keeps none), so that the
        // metrics know it closed.
        self.retired().retire(Instant::now(), id, counters.unwrap_or_default());
        counters
    }

    /// Sessions closed, with their final counters.
    pub fn retired(&self) -> MutexGuard<'_, Retired> {
        self.retired.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Tells every lane that `rank` leaves after its last job: [`Departure::Needed`] if
    /// any lane's rounds still wait for it, `None` if a lane has no such session.
    pub fn depart(&self, id: SessionId, rank: u16) -> Option<Departure> {
        let answers = self.ask_all(|reply| Command::Depart { id, rank, reply });
        let departures: Option<Vec<Departure>> = answers.into_iter().map(Option::flatten).collect();
        let departures = departures?;
        Some(if departures.contains(&Departure::Needed) {
            Departure::Needed
        } else if departures.iter().all(|&departure| departure == Departure::AllGone) {
            Departure::AllGone
        } else {
            Departure::Lingers
        })
    }

    /// Every lane's counters, added up; `None` if a lane does not answer in time.
    pub fn counters(&self, wait: Duration) -> Option<Counters> {
        self.lane_counters(wait)?.into_iter().reduce(add)
    }

    /// Each lane's counters, in lane order; `None` if a lane does not answer in time.
    pub fn lane_counters(&self, wait: Duration) -> Option<Vec<Counters>> {
        let pending: Vec<_> =
            self.commands.iter().map(|lane| send(lane, |reply| Command::Counters { reply })).collect();
        pending.into_iter().map(|answer| answer?.recv_timeout(wait).ok()).collect()
    }

    /// Asks every lane to stop.
    pub fn shut_down(&self) {
        for lane in &self.commands {
            let _ = lane.send(Command::Shutdown);
        }
    }

    /// Sends every lane a command, then waits for each answer; `None` for a lane that
    /// gives none.
    fn ask_all<T>(&self, command: impl Fn(Sender<T>) -> Command) -> Vec<Option<T>> {
        let pending: Vec<_> = self.commands.iter().map(|lane| send(lane, &command)).collect();
        pending
            .into_iter()
            .map(|answer| answer.and_then(|answer| answer.recv_timeout(LANE_WAIT).ok()))
            .collect()
    }

    fn activity(&self) -> std::sync::MutexGuard<'_, FxHashMap<SessionId, Instant>> {
        self.activity.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Sends a lane a command; where its answer will come, unless the lane has stopped.
fn send<T>(
    lane: &Sender<Command>,
    command: impl FnOnce(Sender<T>) -> Command,
) -> Option<crossbeam_channel::Receiver<T>> {
    let (reply, answer) = crossbeam_channel::bounded(1);
    lane.send(command(reply)).ok()?;
    Some(answer)
}

/// Sends a lane a command and waits for its answer; `None` if none comes.
fn ask<T>(lane: &Sender<Command>, command: impl FnOnce(Sender<T>) -> Command) -> Option<T> {
    send(lane, command)?.recv_timeout(LANE_WAIT).ok()
}

/// Two lanes' counters as one switch's.
fn add(sum: Counters, lane: Counters) -> Counters {
    let mut sessions: FxHashMap<SessionId, SessionCounters> = FxHashMap::default();
    for (id, counters) in sum.sessions.into_iter().chain(lane.sessions) {
        let total = sessions.entry(id).or_default();
        *total = *total + counters;
    }
    let mut sessions: Vec<_> = sessions.into_iter().collect();
    sessions.sort_by_key(|&(id, _)| id);
    let faults = match (sum.faults, lane.faults) {
        (Some((a_in, a_out)), Some((b_in, b_out))) => {
            Some((add_faults(a_in, b_in), add_faults(a_out, b_out)))
        }
        (one, other) => one.or(other),
    };
    Counters { engine: sum.engine + lane.engine, sessions, uplink: sum.uplink + lane.uplink, faults }
}

fn add_faults(a: FaultCounters, b: FaultCounters) -> FaultCounters {
    FaultCounters {
        datagrams: a.datagrams + b.datagrams,
        dropped: a.dropped + b.dropped,
        duplicated: a.duplicated + b.duplicated,
        reordered: a.reordered + b.reordered,
        corrupted: a.corrupted + b.corrupted,
        delayed: a.delayed + b.delayed,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use crossbeam_channel::Receiver;

    use super::*;

    /// What each fake lane was asked, with its index.
    type Asked = Arc<Mutex<Vec<(usize, String)>>>;

    const SPEC: SessionSpec = SessionSpec { workers: 2, slots: 4, packet_elements: 8, depth: 2 };

    /// A lane that departs as `departure` says, opens if `opens`, and records what it was
    /// asked.
    fn lane(
        asked: Asked,
        index: usize,
        commands: Receiver<Command>,
        departure: Option<Departure>,
        opens: bool,
    ) {
        std::thread::spawn(move || {
            for command in commands {
                let note = |what: String| asked.lock().unwrap().push((index, what));
                match command {
                    Command::Open { id, reply, .. } => {
                        note(format!("open {id:?}"));
                        let opened = if opens {
                            Ok(id.unwrap_or(SessionId(0x0001_0003)))
                        } else {
                            Err(OpenError::Endpoint("unreachable".into()))
                        };
                        let _ = reply.send(opened);
                    }
                    Command::Close { id, reply } => {
                        note(format!("close {:#x}", id.0));
                        let _ = reply.send(Some(SessionCounters {
                            packets_in: 10 + index as u64,
                            ..Default::default()
                        }));
                    }
                    Command::Depart { reply, .. } => {
                        let _ = reply.send(departure);
                    }
                    Command::Counters { .. } | Command::Shutdown => {}
                }
            }
        });
    }

    fn lanes(answers: &[(Option<Departure>, bool)]) -> (Lanes, Asked) {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let senders = answers
            .iter()
            .enumerate()
            .map(|(index, &(departure, opens))| {
                let (sender, receiver) = crossbeam_channel::unbounded();
                lane(Arc::clone(&asked), index, receiver, departure, opens);
                sender
            })
            .collect();
        (Lanes::new(senders, Activity::default()), asked)
    }

    #[test]
    fn a_session_opens_under_the_first_lane_s_id_and_closes_everywhere_if_one_refuses() {
        let (both, asked) = lanes(&[(None, true), (None, true)]);
        assert_eq!(both.open(SPEC, 7, Vec::new(), None), Ok(SessionId(0x0001_0003)));
        assert_eq!(
            *asked.lock().unwrap(),
            [(0, "open None".into()), (1, "open Some(SessionId(65539))".into())]
        );
        assert_eq!(
            both.close(SessionId(0x0001_0003)).map(|c| c.packets_in),
            Some(21),
            "both lanes' counters"
        );

        let (second_refuses, asked) = lanes(&[(None, true), (None, false)]);
        assert_eq!(
            second_refuses.open(SPEC, 7, Vec::new(), None),
            Err(OpenError::Endpoint("unreachable".into()))
        );
        let mut closes: Vec<_> =
            asked.lock().unwrap().iter().filter(|(_, what)| what.starts_with("close")).cloned().collect();
        closes.sort();
        assert_eq!(closes, [(0, "close 0x10003".into()), (1, "close 0x10003".into())]);
    }

    #[test]
    fn a_departure_is_needed_if_any_lane_needs_it_and_all_gone_only_if_every_lane_says_so() {
        use Departure::{AllGone, Lingers, Needed};
        let id = SessionId(1);
        let cases = [
            (vec![Some(Lingers), Some(Needed)], Some(Needed)),
            (vec![Some(AllGone), Some(AllGone)], Some(AllGone)),
            (vec![Some(AllGone), Some(Lingers)], Some(Lingers)),
            (vec![Some(Lingers), None], None),
        ];
        for (answers, merged) in cases {
            let answers: Vec<_> = answers.into_iter().map(|departure| (departure, true)).collect();
            assert_eq!(lanes(&answers).0.depart(id, 1), merged, "{answers:?}");
        }
    }
}
