//! The gate of a validated stream: events wait in order until what they depend on (their
//! tool call's check, the whole-answer verdict) is decided, then go out in the upstream's
//! order.

use std::collections::{HashSet, VecDeque};

use super::Plan;
use crate::{validation::stream::Read, wire::sse::SseEvent};

/// An event waiting to be released.
pub(super) struct Queued {
    pub(super) event: SseEvent,
    pub(super) call: Option<u64>,
    pub(super) terminal: bool,
    pub(super) opening: bool,
}

/// Holds events until what they wait for is checked, and releases them in order.
pub(super) struct Gate {
    pub(super) queue: VecDeque<Queued>,
    pub(super) unchecked: HashSet<u64>,
    pub(super) hold_all: bool,
    pub(super) hold_terminal: bool,
    /// Something past the opening events was released.
    pub(super) opened: bool,
}

impl Gate {
    pub(super) fn new(plan: Plan, checks_content: bool) -> Gate {
        Gate {
            queue: VecDeque::new(),
            unchecked: HashSet::new(),
            hold_all: plan == Plan::Buffer && checks_content,
            hold_terminal: checks_content,
            opened: false,
        }
    }

    pub(super) fn push(&mut self, event: SseEvent, read: &Read, hold_calls: bool) {
        let call = read.call.filter(|_| hold_calls);
        if let Some(call) = call {
            self.unchecked.insert(call);
        }
        self.queue.push_back(Queued {
            event,
            call,
            terminal: read.terminal,
            opening: read.opening,
        });
    }

    /// Whether `q` must wait (for its call's check, or the whole-answer verdict).
    fn waits(&self, q: &Queued) -> bool {
        self.hold_all
            || q.call.is_some_and(|c| self.unchecked.contains(&c))
            || (q.terminal && self.hold_terminal)
    }

    pub(super) fn release(&mut self) -> Vec<Queued> {
        let mut out = Vec::new();
        if !self.opened {
            // Opening events go with the first event after them, once it can.
            match self.queue.iter().find(|q| !q.opening) {
                Some(first) if !self.waits(first) => self.opened = true,
                _ => return out,
            }
        }
        while let Some(front) = self.queue.front() {
            if self.waits(front) {
                break;
            }
            out.extend(self.queue.pop_front());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(n: u64) -> SseEvent {
        SseEvent::write(None, &serde_json::json!({ "n": n }))
    }

    fn read(call: Option<u64>, terminal: bool, opening: bool) -> Read {
        Read {
            call,
            completed: Vec::new(),
            terminal,
            opening,
        }
    }

    fn released(gate: &mut Gate) -> Vec<u64> {
        gate.release()
            .iter()
            .filter_map(|q| q.event.json.as_ref()?.get("n")?.as_u64())
            .collect()
    }

    #[test]
    fn a_call_holds_what_follows_it_until_it_is_checked() {
        let mut gate = Gate::new(Plan::Incremental, false);
        gate.push(event(0), &read(None, false, true), true);
        assert_eq!(released(&mut gate), [] as [u64; 0], "an opening waits");
        gate.push(event(1), &read(Some(7), false, false), true);
        gate.push(event(2), &read(None, false, false), true);
        assert_eq!(released(&mut gate), [] as [u64; 0], "the call is unchecked");
        gate.unchecked.remove(&7);
        assert_eq!(released(&mut gate), [0, 1, 2]);
    }

    #[test]
    fn a_content_schema_holds_the_closing_event_and_buffer_holds_everything() {
        let mut gate = Gate::new(Plan::Incremental, true);
        gate.push(event(0), &read(None, false, false), true);
        gate.push(event(1), &read(None, true, false), true);
        assert_eq!(released(&mut gate), [0]);
        let mut buffered = Gate::new(Plan::Buffer, true);
        buffered.push(event(0), &read(None, false, false), true);
        assert_eq!(released(&mut buffered), [] as [u64; 0]);
        buffered.hold_all = false;
        buffered.hold_terminal = false;
        assert_eq!(released(&mut buffered), [0]);
    }
}
