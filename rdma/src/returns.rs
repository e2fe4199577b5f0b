//! What came back of a failing connection's posted requests, counted by queue and
//! status, so that its error says whether every request came back (none lost with the
//! queue pair) and how each one ended.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use rdma_sys::ibv_wc_status;

use crate::verbs::ibv::status_name;

/// The queue a request was posted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Queue {
    Receive,
    Send,
}

/// Completions of a failing connection, from its first failed one on, by queue and
/// status; and the requests that had not come back when the wait for them ended.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Returns {
    counts: BTreeMap<(Queue, ibv_wc_status::Type), usize>,
    /// The first status counted that names a cause: neither success nor flushed.
    cause: Option<ibv_wc_status::Type>,
    missing: Option<(usize, Duration)>,
}

impl Returns {
    /// Counts one completion of `queue` that ended with `status`.
    pub fn count(&mut self, queue: Queue, status: ibv_wc_status::Type) {
        *self.counts.entry((queue, status)).or_default() += 1;
        let flushed = [ibv_wc_status::IBV_WC_SUCCESS, ibv_wc_status::IBV_WC_WR_FLUSH_ERR];
        if self.cause.is_none() && !flushed.contains(&status) {
            self.cause = Some(status);
        }
    }

    /// The first status counted that says why the connection failed: a flushed request
    /// only says that its queue pair was in error already.
    pub fn cause(&self) -> Option<ibv_wc_status::Type> {
        self.cause
    }

    /// `requests` posted had not come back after waiting `waited` for them.
    pub fn missing(&mut self, requests: usize, waited: Duration) {
        self.missing = (requests > 0).then_some((requests, waited));
    }

    fn total(&self, queue: Queue) -> usize {
        self.counts.iter().filter(|((counted, _), _)| *counted == queue).map(|(_, count)| count).sum()
    }
}

impl fmt::Display for Returns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (queue, name, separator) in [(Queue::Receive, "receives", ""), (Queue::Send, "sends", ", ")] {
            write!(f, "{separator}{} {name} came back", self.total(queue))?;
            let statuses: Vec<String> = self
                .counts
                .iter()
                .filter(|((counted, _), _)| *counted == queue)
                .map(|(&(_, status), count)| format!("{count} {}", status_name(status)))
                .collect();
            if !statuses.is_empty() {
                write!(f, " ({})", statuses.join(", "))?;
            }
        }
        match self.missing {
            None => write!(f, ", every request posted"),
            Some((requests, waited)) => write!(f, ", {requests} posted did not within {waited:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_returns_say_each_queue_s_statuses_and_that_none_was_lost() {
        let mut returns = Returns::default();
        for _ in 0..31 {
            returns.count(Queue::Receive, ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
        }
        returns.count(Queue::Send, ibv_wc_status::IBV_WC_SUCCESS);
        returns.count(Queue::Receive, ibv_wc_status::IBV_WC_LOC_LEN_ERR);
        returns.count(Queue::Send, ibv_wc_status::IBV_WC_REM_INV_REQ_ERR);
        returns.missing(0, Duration::from_secs(1));
        assert_eq!(
            returns.to_string(),
            "32 receives came back (1 local length error, 31 Work Request Flushed Error), 2 sends came back \
             (1 success, 1 remote invalid request error), every request posted"
        );
        // The flushed requests came first, but only the length error says why.
        assert_eq!(returns.cause(), Some(ibv_wc_status::IBV_WC_LOC_LEN_ERR));
    }

    #[test]
    fn requests_that_never_came_back_are_counted_with_the_wait() {
        let mut returns = Returns::default();
        returns.missing(3, Duration::from_secs(1));
        assert_eq!(
            returns.to_string(),
            "0 receives came back, 0 sends came back, 3 posted did not within 1s"
        );
    }
}
