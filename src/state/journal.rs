//! Sessions' side-effect journals ([`crate::policy::side_effects`]): per (tenant,
//! session) the calls of listed tools the session proposed, committed (their result fed
//! back) or saw fail, kept in the store ([`Journals`]) so that they outlive this
//! process and, in replica mode, are every replica's. Entries are versioned JSON; one
//! this build cannot read is left out (logged), never taken for another.

use std::{collections::HashMap, sync::Arc};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::{
    api::tool_calls::{ToolCall, ToolResult},
    clock::Clock,
    policy::side_effects::{
        call_key, canonical_args, digest, result_failed, truncated, Record, SideEffectPolicy,
        RESULT_BYTES,
    },
    store::{JournalRecord, Journals, StoreError},
};

/// The entries' format version.
const ENTRY_VERSION: u32 = 1;

/// Where a journaled call stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Proposed by an answer, no result seen yet.
    Proposed,
    /// Its result was fed back: the side effect is done.
    Ok,
    /// Its result says it failed: not committed, a retry is legitimate.
    Error,
}

/// One journaled call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub v: u32,
    pub call_id: String,
    pub tool: String,
    /// What a repeat is matched by: the tool and its canonical arguments, hashed.
    pub key: String,
    /// The canonical arguments (`record = "full"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<String>,
    pub args_hash: String,
    /// The result, cut to [`RESULT_BYTES`] (`record = "full"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_hash: Option<String>,
    pub outcome: Outcome,
    /// When it was journaled (ms since the epoch).
    pub at_ms: i64,
    /// Times an answer proposed it again after it was committed.
    #[serde(default)]
    pub repeats: u32,
    /// Of those, repeats the agent declared (`x-backstop-allow-repeat`).
    #[serde(default)]
    pub deliberate: u32,
}

impl Entry {
    /// A call, as `record` keeps it.
    fn of(call: &ToolCall, record: Record, at_ms: i64) -> Entry {
        let canonical = canonical_args(&call.args);
        Entry {
            v: ENTRY_VERSION,
            call_id: call.id.clone(),
            tool: call.tool.clone(),
            key: call_key(&call.tool, &canonical),
            args_hash: digest(&canonical),
            args: (record == Record::Full).then_some(canonical),
            result: None,
            result_hash: None,
            outcome: Outcome::Proposed,
            at_ms,
            repeats: 0,
            deliberate: 0,
        }
    }

    /// The entry with its result fed back.
    fn answered(mut self, result: &ToolResult, record: Record, at_ms: i64) -> Entry {
        self.outcome = if result_failed(result.is_error, &result.content) {
            Outcome::Error
        } else {
            Outcome::Ok
        };
        self.result_hash = Some(digest(&result.content));
        self.result =
            (record == Record::Full).then(|| truncated(&result.content, RESULT_BYTES).to_string());
        self.at_ms = at_ms;
        self
    }

    pub fn is_committed(&self) -> bool {
        self.outcome == Outcome::Ok
    }

    /// The entry as `GET /v1/sessions/{id}/journal` shows it.
    pub fn to_json(&self) -> Value {
        json!({
            "call_id": self.call_id,
            "tool": self.tool,
            "arguments": self.args,
            "arguments_hash": self.args_hash,
            "result": self.result,
            "result_hash": self.result_hash,
            "outcome": self.outcome,
            "at_ms": self.at_ms,
            "repeats": self.repeats,
            "deliberate_repeats": self.deliberate,
        })
    }

    fn record(&self) -> JournalRecord {
        JournalRecord {
            call_id: self.call_id.clone(),
            at_ms: self.at_ms,
            proposed: self.outcome == Outcome::Proposed,
            entry: serde_json::to_string(self).unwrap_or_default(),
        }
    }
}

/// A session's journal as read at the start of a request.
#[derive(Debug, Default)]
pub struct Session {
    pub entries: Vec<Entry>,
}

impl Session {
    /// The committed entry an answer's call repeats, if any.
    pub fn committed(&self, call: &ToolCall) -> Option<&Entry> {
        let key = call_key(&call.tool, &canonical_args(&call.args));
        self.entries
            .iter()
            .rev()
            .find(|e| e.is_committed() && e.key == key)
    }

    fn by_id(&self, call_id: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.call_id == call_id)
    }
}

/// The journals of every session, over the store.
pub struct Journal {
    store: Arc<dyn Journals>,
    clock: Clock,
    /// How long a session's journal outlives its last write where the store expires it.
    ttl_ms: u64,
}

impl Journal {
    pub fn new(store: Arc<dyn Journals>, clock: Clock, ttl_ms: u64) -> Journal {
        Journal {
            store,
            clock,
            ttl_ms,
        }
    }

    /// A session's journal, oldest first.
    pub async fn session(&self, tenant: &str, session: &str) -> Result<Session, StoreError> {
        let records = self.store.journal(tenant, session).await?;
        let entries = records
            .into_iter()
            .filter_map(|r| match serde_json::from_str::<Entry>(&r.entry) {
                Ok(entry) if entry.v == ENTRY_VERSION => Some(entry),
                _ => {
                    tracing::warn!(
                        tenant,
                        session,
                        call_id = r.call_id,
                        "a journal entry in a format this build does not read is left out"
                    );
                    None
                }
            })
            .collect();
        Ok(Session { entries })
    }

    /// The results a request feeds back for the policy's tools, journaled (committed or
    /// failed) before the request goes on: the entries written. A result whose call is
    /// neither in the request nor journaled as proposed says nothing of its tool and is
    /// not journaled; one already journaled is not journaled again.
    pub async fn commit(
        &self,
        tenant: &str,
        session_id: &str,
        session: &mut Session,
        policy: &SideEffectPolicy,
        (calls, results): (&[ToolCall], &[ToolResult]),
    ) -> Result<Vec<Entry>, StoreError> {
        let now = self.clock.now_ms();
        let calls: HashMap<&str, &ToolCall> = calls.iter().map(|c| (c.id.as_str(), c)).collect();
        let mut written = Vec::new();
        for result in results {
            let known = session.by_id(&result.call_id);
            if known.is_some_and(|e| e.outcome != Outcome::Proposed)
                || written.iter().any(|e: &Entry| e.call_id == result.call_id)
            {
                continue;
            }
            let entry = match (calls.get(result.call_id.as_str()), known) {
                (Some(call), _) if policy.lists(&call.tool) => Entry::of(call, policy.record, now),
                (None, Some(proposed)) if policy.lists(&proposed.tool) => proposed.clone(),
                _ => continue,
            };
            written.push(entry.answered(result, policy.record, now));
        }
        if written.is_empty() {
            return Ok(written);
        }
        self.write(tenant, session_id, &written, policy.max_entries)
            .await?;
        for entry in &written {
            session.entries.retain(|e| e.call_id != entry.call_id);
            session.entries.push(entry.clone());
        }
        Ok(written)
    }

    /// Calls an answer proposed (of listed tools, not yet journaled), journaled as
    /// proposed: a later result naming only their id (a Responses chain) is then known.
    pub async fn propose(
        &self,
        tenant: &str,
        session_id: &str,
        session: &Session,
        policy: &SideEffectPolicy,
        calls: &[&ToolCall],
    ) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        let new: Vec<Entry> = calls
            .iter()
            .filter(|c| session.by_id(&c.id).is_none())
            .map(|c| Entry::of(c, policy.record, now))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        self.write(tenant, session_id, &new, policy.max_entries)
            .await
    }

    /// Counts a repeat of the committed entry of `call_id` (deliberate or not), in
    /// `session` too, so that the next repeat in the same request counts from it. (Two
    /// requests counting at once may count one repeat fewer: the count is a signal.)
    pub async fn repeated(
        &self,
        tenant: &str,
        session_id: &str,
        session: &mut Session,
        call_id: &str,
        deliberate: bool,
        max_entries: usize,
    ) -> Result<(), StoreError> {
        let Some(entry) = session.entries.iter_mut().find(|e| e.call_id == call_id) else {
            return Ok(());
        };
        entry.repeats += 1;
        entry.deliberate += u32::from(deliberate);
        let entry = entry.clone();
        self.write(tenant, session_id, &[entry], max_entries).await
    }

    async fn write(
        &self,
        tenant: &str,
        session: &str,
        entries: &[Entry],
        max_entries: usize,
    ) -> Result<(), StoreError> {
        let records = entries.iter().map(Entry::record).collect();
        self.store
            .write_journal(tenant, session, records, max_entries, self.ttl_ms)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{policy::side_effects::OnRepeat, store::SqliteStore};

    fn policy(record: Record, max_entries: usize) -> SideEffectPolicy {
        SideEffectPolicy {
            tools: vec!["send_*".into()],
            only: None,
            on_repeat: OnRepeat::Correct,
            record,
            restore: false,
            fail_closed: false,
            max_entries,
        }
    }

    fn call(id: &str, tool: &str, args: &str) -> ToolCall {
        ToolCall {
            id: id.into(),
            tool: tool.into(),
            args: args.into(),
        }
    }

    fn result(id: &str, content: &str) -> ToolResult {
        ToolResult {
            call_id: id.into(),
            content: content.into(),
            is_error: false,
        }
    }

    fn journal() -> Journal {
        let store = Arc::new(SqliteStore::open(":memory:").unwrap());
        Journal::new(store, Clock::starting_at(1_800_000_000_000), 600_000)
    }

    #[tokio::test]
    async fn a_listed_calls_result_commits_it_once_and_a_failed_one_does_not() {
        let j = journal();
        let p = policy(Record::Full, 100);
        let mut s = j.session("t", "s").await.unwrap();
        let calls = [
            call("1", "send_email", r#"{"to": "bob", "body": "hi"}"#),
            call("2", "send_sms", "{}"),
            call("3", "get_weather", "{}"),
        ];
        let results = [
            result("1", "sent"),
            result("2", r#"{"error": "no signal"}"#),
            result("3", "sunny"),
            result("9", "an answer to no call"),
        ];
        let written = j
            .commit("t", "s", &mut s, &p, (&calls, &results))
            .await
            .unwrap();
        let outcomes: Vec<_> = written
            .iter()
            .map(|e| (e.call_id.as_str(), e.outcome))
            .collect();
        assert_eq!(outcomes, [("1", Outcome::Ok), ("2", Outcome::Error)]);
        // Read back from the store, as the next request (or replica) does.
        let again = j.session("t", "s").await.unwrap();
        assert_eq!(again.entries, written);
        assert_eq!(
            again.entries[0].args.as_deref(),
            Some(r#"{"body":"hi","to":"bob"}"#)
        );
        assert_eq!(again.entries[0].result.as_deref(), Some("sent"));
        let repeat = call("7", "send_email", r#"{"body":"hi","to":"bob"}"#);
        assert_eq!(
            again.committed(&repeat).map(|e| e.call_id.as_str()),
            Some("1")
        );
        assert!(
            again.committed(&call("8", "send_sms", "{}")).is_none(),
            "failed: retryable"
        );
        assert!(again
            .committed(&call("8", "send_email", r#"{"to":"eve"}"#))
            .is_none());
        // The same results fed back again (every later turn carries them): nothing new.
        let mut s = again;
        let none = j
            .commit("t", "s", &mut s, &p, (&calls, &results))
            .await
            .unwrap();
        assert!(none.is_empty());
    }

    #[tokio::test]
    async fn a_proposed_call_is_committed_by_a_result_naming_only_its_id() {
        let j = journal();
        let p = policy(Record::Hash, 100);
        let s = j.session("t", "s").await.unwrap();
        let proposed = call("c1", "send_email", r#"{"to":"bob"}"#);
        j.propose("t", "s", &s, &p, &[&proposed]).await.unwrap();
        let mut s = j.session("t", "s").await.unwrap();
        assert_eq!(s.entries[0].outcome, Outcome::Proposed);
        let written = j
            .commit("t", "s", &mut s, &p, (&[], &[result("c1", "sent")]))
            .await
            .unwrap();
        assert_eq!(written[0].outcome, Outcome::Ok);
        assert_eq!(
            (written[0].args.as_ref(), written[0].result.as_ref()),
            (None, None),
            "hashes only"
        );
        assert!(written[0].result_hash.is_some());
        assert!(j
            .session("t", "s")
            .await
            .unwrap()
            .committed(&proposed)
            .is_some());
    }

    #[tokio::test]
    async fn a_session_keeps_its_newest_max_entries() {
        let j = journal();
        let p = policy(Record::Full, 2);
        for n in 0..4 {
            let mut s = j.session("t", "s").await.unwrap();
            j.clock.skip(std::time::Duration::from_millis(5));
            let id = format!("c{n}");
            let calls = [call(&id, "send_email", &format!(r#"{{"n":{n}}}"#))];
            j.commit("t", "s", &mut s, &p, (&calls, &[result(&id, "ok")]))
                .await
                .unwrap();
        }
        let ids: Vec<_> = j
            .session("t", "s")
            .await
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.call_id)
            .collect();
        assert_eq!(ids, ["c2", "c3"]);
        assert!(j.session("t", "other").await.unwrap().entries.is_empty());
        assert!(
            j.session("u", "s").await.unwrap().entries.is_empty(),
            "per tenant"
        );
    }
}
