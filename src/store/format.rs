//! The formats of the records replicas share in Redis, where two releases meet during a
//! rolling upgrade: a session guard's shared snapshot, a session's kept close or trip, an
//! idempotency key's kept response, and a stored response's owner. (The reservations the
//! budget scripts write are versioned in [`crate::state::shared`].)
//!
//! Every record names the version of its format, `"v"`, first. A record without one was
//! written before formats had versions: it is version 0, a known format (each decoder
//! below says what it was), and is read as such. A build reads every version up to its
//! own and refuses any other, or a record that does not parse, as an [`UnknownFormat`]:
//! logged, counted in `backstop_state_unknown_format_total{record}`, and never read as a
//! default. Each reader then does the conservative thing:
//! - a guard snapshot or kept close/trip: this replica refuses the session's requests
//!   (503 `state_unavailable`) instead of starting it over as active; an operator's close
//!   or reset still applies (it replaces what was there);
//! - an idempotency record: the key counts as taken by a request still running
//!   ([`super::Claim::Pending`]), never as a miss that would make the call again;
//! - an owner: the response's owner cannot be checked ([`super::StoreError::UnknownFormat`],
//!   503), so the response is neither served nor chained onto.
//!
//! A change that an older build would misread takes a new version; the tests below pin
//! the bytes of each version, so a format cannot change without one of them failing.

use std::{
    borrow::Cow,
    sync::atomic::{AtomicU64, Ordering},
};

use base64::Engine;
use serde::{Deserialize, Serialize};

use super::{GuardRecord, StoredOwner, StoredResponse};
use crate::policy::guard::Phase;

/// A guard's counted state on the wall clock (ms since the epoch), as replicas share it.
/// Stored with its format version ([`encode_snapshot`]); `state::guard_view` makes it
/// from a guard and a guard from it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuardSnapshot {
    pub phase: Phase,
    pub until_ms: i64,
    pub code: Option<String>,
    pub rule: Option<String>,
    pub evidence: Option<String>,
    pub consecutive_failures: u32,
    /// (when, [`RequestFingerprint::request`](crate::policy::guard::RequestFingerprint::request)), oldest first.
    pub recent: Vec<(i64, u64)>,
    pub spend: Vec<(i64, f64)>,
    pub transitions: u64,
    /// The fleet signature a `fleet_pattern` trip was predicted from. Written only when
    /// there is one (so every other snapshot's bytes are version 1's as they were); a
    /// build that does not know the field ignores it, and loses only the credit of the
    /// trip's refusals to its signature.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<u64>,
    /// What the restart strategies remember (guidance, the trouble's start, a repeated
    /// provider refusal). Written only when there is something (every other snapshot's
    /// bytes are as they were); a guided or waiting snapshot has a phase an older build
    /// does not read at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<RestartSnapshot>,
}

/// [`GuardSnapshot::restart`]: a guard's [`Restart`](crate::policy::guard::Restart) and
/// a guided state's loop, times on the wall clock.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RestartSnapshot {
    /// When the identical-request and tool-loop rules last guided the session.
    #[serde(default)]
    pub guided_ms: [Option<i64>; 2],
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_floor: Option<(u64, u32)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub troubled_ms: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_error: Option<(u64, u32)>,
    /// A guided state's loop: the identical request, the tool loop's key and count, the
    /// looping result (the rule and evidence are the snapshot's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guide: Option<GuideSnapshot>,
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GuideSnapshot {
    pub request: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<(u64, u32)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
}

/// The records with a versioned format (the `record` label of the count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// A session guard's counted state, shared by the replicas (`guard-window:{session}`).
    GuardSnapshot,
    /// A session's close or trip, kept past the guard's memory (`guard:{session}`).
    GuardRecord,
    /// A kept response for an `Idempotency-Key` (`idempotency:{key}`).
    Idempotency,
    /// The tenant that created a stored response of the Responses API (`owner:{id}`).
    Owner,
}

impl Record {
    pub fn label(self) -> &'static str {
        match self {
            Record::GuardSnapshot => "guard_snapshot",
            Record::GuardRecord => "guard_record",
            Record::Idempotency => "idempotency",
            Record::Owner => "owner",
        }
    }

    /// The version this build writes, the newest it reads.
    pub fn version(self) -> u64 {
        match self {
            Record::GuardSnapshot => 1,
            Record::GuardRecord => 1,
            Record::Idempotency => 1,
            Record::Owner => 1,
        }
    }
}

/// A record this build cannot read: of a version it does not know (written by a newer
/// release), or that does not parse (an unknown guard phase, say).
#[derive(Debug, Clone, PartialEq)]
pub struct UnknownFormat {
    pub record: Record,
    /// The version the record names, when it could be read.
    pub version: Option<u64>,
    pub detail: String,
}

impl std::fmt::Display for UnknownFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (record, newest) = (self.record.label(), self.record.version());
        match self.version {
            Some(v) => write!(
                f,
                "{record} record of format version {v}, which this build does not read (it reads versions 0 to {newest}): written by a newer Backstop?"
            ),
            None => write!(f, "{record} record this build cannot read: {}", self.detail),
        }
    }
}

impl std::error::Error for UnknownFormat {}

impl UnknownFormat {
    fn version(record: Record, v: u64) -> Self {
        UnknownFormat {
            record,
            version: Some(v),
            detail: String::new(),
        }
    }

    fn unparsed(record: Record, err: impl std::fmt::Display) -> Self {
        UnknownFormat {
            record,
            version: None,
            detail: err.to_string(),
        }
    }

    /// Counts the refusal in `backstop_state_unknown_format_total{record}` and logs it
    /// (at most once a second per record: a request waiting on an idempotency key reads
    /// it every 25 ms). `at` says where it was read (its key, or tenant and session).
    pub fn report(&self, at: &str) {
        let record = self.record.label();
        metrics::counter!("backstop_state_unknown_format_total", "record" => record).increment(1);
        // The second each record was last logged in, by `Record as usize`.
        static LOGGED: [AtomicU64; 8] = [const { AtomicU64::new(u64::MAX) }; 8];
        static START: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
        let second = START
            .get_or_init(tokio::time::Instant::now)
            .elapsed()
            .as_secs();
        let logged = LOGGED
            .get(self.record as usize)
            .is_some_and(|last| last.swap(second, Ordering::Relaxed) == second);
        if !logged {
            tracing::error!(
                record,
                version = self.version,
                at,
                error = %self,
                "refused a shared record in a format this build does not know"
            );
        }
    }
}

/// A record's fields after its version, `"v"`.
#[derive(Serialize)]
struct Versioned<'a, T> {
    v: u64,
    #[serde(flatten)]
    record: &'a T,
}

fn versioned<T: Serialize>(record: Record, fields: &T) -> String {
    // Plain structs of strings and numbers: serializing them cannot fail.
    serde_json::to_string(&Versioned {
        v: record.version(),
        record: fields,
    })
    .unwrap_or_default()
}

/// The version a JSON record names; 0 when it names none (written before versions).
fn version_of(record: Record, text: &str) -> Result<u64, UnknownFormat> {
    #[derive(Deserialize)]
    struct Version {
        #[serde(default)]
        v: u64,
    }
    serde_json::from_str::<Version>(text)
        .map(|version| version.v)
        .map_err(|err| UnknownFormat::unparsed(record, err))
}

fn parse<'a, T: Deserialize<'a>>(record: Record, text: &'a str) -> Result<T, UnknownFormat> {
    serde_json::from_str(text).map_err(|err| UnknownFormat::unparsed(record, err))
}

/// How a stored snapshot (version 1) of a guard that admits requests (active or
/// recovering) begins. The Redis scripts that add a request to a snapshot or tell
/// whether it is quiet read it by these prefixes (and `"recent":[`, which follows
/// `"consecutive_failures"`), so they hold only for the version this build writes: a
/// snapshot of another version never matches, and is left to be decoded here. The
/// scripts hold them (and [`QUIET_PREFIX`]) as version 2 begins them
/// ([`beside_prefix`]), as literals: `src/state/redis/gate.lua` and `prelude_brief.lua`,
/// pinned to these by a test there.
pub const ADMITTING_PREFIXES: [&str; 2] = [
    r#"{"v":1,"phase":"active","#,
    r#"{"v":1,"phase":"recovering","#,
];

/// How a stored snapshot of a quiet guard begins: active, no failures in a row.
pub const QUIET_PREFIX: &str = r#"{"v":1,"phase":"active","until_ms":0,"code":null,"rule":null,"evidence":null,"consecutive_failures":0,"recent":["#;

/// How a snapshot of version 1 begins.
const V1: &str = r#"{"v":1,"#;
/// How a snapshot of version 2 begins: the form Redis keeps ([`to_beside`]).
const V2: &str = r#"{"v":2,"#;
/// Where a snapshot's window of requests begins and ends (only numbers between: a quote
/// inside a JSON string is escaped, so neither can be part of one).
const RECENT_OPEN: &str = r#""recent":["#;
const RECENT_CLOSE: &str = r#"],"spend":["#;

/// Where the window's entries are in a snapshot's text: from after `"recent":[` to
/// before `],"spend":[`.
fn window_span(text: &str) -> Option<(usize, usize)> {
    let open = text.find(RECENT_OPEN)? + RECENT_OPEN.len();
    Some((open, open + text[open..].find(RECENT_CLOSE)?))
}

/// A prefix of version 1 ([`ADMITTING_PREFIXES`], [`QUIET_PREFIX`]) as version 2 has it.
pub fn beside_prefix(prefix: &str) -> String {
    format!("{V2}{}", prefix.strip_prefix(V1).unwrap_or(prefix))
}

/// What a whole write of a guard's shared state does to its window of requests, where
/// Redis keeps the window beside the state ([`to_beside`]). A store that keeps the whole
/// snapshot (PostgreSQL) ignores it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WindowWrite {
    /// Left as it is: only an admission adds to the window (an outcome, a failure or a
    /// trip does not).
    Keep,
    /// The admitted request added at `at_ms` (on the wall clock), once entries from
    /// before `since_ms` are dropped; the window then keeps its last 256 entries, as the
    /// guard does.
    Append {
        at_ms: i64,
        request: u64,
        since_ms: i64,
    },
    /// Replaced by the snapshot's own window (an operator's reset or close, or a state
    /// this replica has no version of yet).
    Replace,
}

/// A snapshot of version 1 as Redis keeps it: version 2, the same fields with `recent`
/// empty, its window kept beside it (a list of `ms,fingerprint` and a hash of each
/// fingerprint's count, which scripts extend in place: a window is kilobytes, which
/// Redis's Lua is slow to copy); and the window's entries as version 1 has them
/// (`[ms,fingerprint],...`). A build that reads only version 1 refuses version 2
/// (loudly), never reads it as an empty window. `None` for text of any other shape: kept
/// as it is.
pub fn to_beside(text: &str) -> Option<(String, &str)> {
    let rest = text.strip_prefix(V1)?;
    let (open, close) = window_span(rest)?;
    let mut state = String::with_capacity(V2.len() + rest.len() - (close - open));
    state.push_str(V2);
    state.push_str(&rest[..open]);
    state.push_str(&rest[close..]);
    Some((state, &rest[open..close]))
}

/// The version 1 snapshot of a version 2 state and the window read from beside it
/// (`ms,fingerprint` entries joined by `;`); any other text as it is (a version 1 state
/// an older build wrote holds its own window).
pub fn from_beside(state: &str, window: &str) -> String {
    let Some(rest) = state.strip_prefix(V2) else {
        return state.to_string();
    };
    let Some(open) = rest.find(RECENT_OPEN).map(|at| at + RECENT_OPEN.len()) else {
        return state.to_string();
    };
    let mut text = String::with_capacity(state.len() + window.len() * 2);
    text.push_str(V1);
    text.push_str(&rest[..open]);
    for (i, entry) in window.split(';').filter(|e| !e.is_empty()).enumerate() {
        if i > 0 {
            text.push(',');
        }
        text.push('[');
        text.push_str(entry);
        text.push(']');
    }
    text.push_str(&rest[open..]);
    text
}

/// The field of a window's counts that is no count: its value, longer than any
/// `hash-max-listpack-value` (64 by default), makes Redis keep the hash as a hash table
/// for good. Redis keeps a hash of up to `hash-max-listpack-entries` fields (128, or
/// 512 on some builds) as a listpack, which it searches and shifts end to end on every
/// count it reads, adds or drops: with a full window of 256 requests, that cost the gate
/// and the settle a tenth of their Redis time (docs/performance.md). Readers of the
/// counts skip it.
pub const HASHED_FIELD: &str = "_";
/// The length of [`HASHED_FIELD`]'s value, all `h` (written as a literal in
/// `src/state/redis/prelude_window.lua`).
pub const HASHED_VALUE_LEN: usize = 80;

/// What a whole write of `state` (version 1 text) at `version` sends to Redis: the state
/// as Redis keeps it, and the window's op and argument as the scripts take them
/// (`window_write` in `src/state/redis/prelude_window.lua`). A state with no version yet
/// replaces whatever window is there (none, or one left after its state expired); text
/// of any other shape is kept as it is, with no window beside it.
pub fn beside_write(
    state: &str,
    window: WindowWrite,
    version: u64,
) -> (String, &'static str, String) {
    match to_beside(state) {
        Some((beside, entries)) => {
            let write = if version == 0 {
                WindowWrite::Replace
            } else {
                window
            };
            let (op, arg) = match write {
                WindowWrite::Keep => ("", String::new()),
                WindowWrite::Append {
                    at_ms,
                    request,
                    since_ms,
                } => ("a", format!("{at_ms},{request},{since_ms}")),
                WindowWrite::Replace => ("r", entries.to_string()),
            };
            (beside, op, arg)
        }
        None => (state.to_string(), "r", String::new()),
    }
}

/// [`to_beside`] of a snapshot cut in parts (a fleet trip's, whose counts go between
/// them): the first part's version made 2, and the window left out of whichever part
/// holds it.
pub fn parts_beside(parts: &[String]) -> Vec<String> {
    parts
        .iter()
        .enumerate()
        .map(|(i, part)| {
            let mut part = match part.strip_prefix(V1) {
                Some(rest) if i == 0 => format!("{V2}{rest}"),
                _ => part.clone(),
            };
            if let Some((open, close)) = window_span(&part) {
                part.replace_range(open..close, "");
            }
            part
        })
        .collect()
}

/// A guard snapshot as stored: `{"v":1,"phase":..}`, the [`GuardSnapshot`]'s fields
/// in order (see the golden test).
pub fn encode_snapshot(snapshot: &GuardSnapshot) -> String {
    versioned(Record::GuardSnapshot, snapshot)
}

/// Version 0 has version 1's fields; its `recent` fingerprints were std's
/// `DefaultHasher`'s, which match no XXH3 fingerprint, and age out of the window. A
/// phase this build does not know does not parse.
pub fn decode_snapshot(text: &str) -> Result<GuardSnapshot, UnknownFormat> {
    let record = Record::GuardSnapshot;
    match version_of(record, text)? {
        0 | 1 => parse(record, text),
        v => Err(UnknownFormat::version(record, v)),
    }
}

/// A kept close or trip's fields (after `"v"`).
#[derive(Serialize, Deserialize)]
struct Kept<'a> {
    closed: bool,
    until_ms: i64,
    code: Cow<'a, str>,
    rule: Cow<'a, str>,
    evidence: Cow<'a, str>,
    updated_ms: i64,
}

/// `{"v":1,"closed":..,"until_ms":..,"code":..,"rule":..,"evidence":..,"updated_ms":..}`
/// (the record's tenant and session are in its key).
pub fn encode_guard_record(r: &GuardRecord) -> String {
    versioned(
        Record::GuardRecord,
        &Kept {
            closed: r.closed,
            until_ms: r.until_ms,
            code: Cow::Borrowed(&r.code),
            rule: Cow::Borrowed(&r.rule),
            evidence: Cow::Borrowed(&r.evidence),
            updated_ms: r.updated_ms,
        },
    )
}

/// Version 0 has version 1's fields, without `"v"`.
pub fn decode_guard_record(
    tenant: &str,
    session: &str,
    text: &str,
) -> Result<GuardRecord, UnknownFormat> {
    let record = Record::GuardRecord;
    let kept: Kept<'_> = match version_of(record, text)? {
        0 | 1 => parse(record, text)?,
        v => return Err(UnknownFormat::version(record, v)),
    };
    Ok(GuardRecord {
        tenant: tenant.to_string(),
        session: session.to_string(),
        closed: kept.closed,
        until_ms: kept.until_ms,
        code: kept.code.into_owned(),
        rule: kept.rule.into_owned(),
        evidence: kept.evidence.into_owned(),
        updated_ms: kept.updated_ms,
    })
}

/// A kept response's fields (after `"v"`); the body in standard base64.
#[derive(Serialize, Deserialize)]
struct Response<'a> {
    body_hash: Cow<'a, str>,
    status: u16,
    content_type: Cow<'a, str>,
    body: String,
}

/// `{"v":1,"body_hash":..,"status":..,"content_type":..,"body":base64}` (the tenant and
/// key are in the record's key; its expiry is the key's). A claim in progress is the
/// bare string `pending`, which carries nothing to version: any value a build does not
/// read is taken for a claim in progress.
pub fn encode_response(r: &StoredResponse) -> String {
    versioned(
        Record::Idempotency,
        &Response {
            body_hash: Cow::Borrowed(&r.body_hash),
            status: r.status,
            content_type: Cow::Borrowed(&r.content_type),
            body: base64::engine::general_purpose::STANDARD.encode(&r.body),
        },
    )
}

/// Version 0 has version 1's fields, without `"v"`.
pub fn decode_response(
    tenant: &str,
    key: &str,
    text: &str,
) -> Result<StoredResponse, UnknownFormat> {
    let record = Record::Idempotency;
    let response: Response<'_> = match version_of(record, text)? {
        0 | 1 => parse(record, text)?,
        v => return Err(UnknownFormat::version(record, v)),
    };
    let body = base64::engine::general_purpose::STANDARD
        .decode(response.body.as_bytes())
        .map_err(|err| UnknownFormat::unparsed(record, format!("body: {err}")))?;
    Ok(StoredResponse {
        tenant: tenant.to_string(),
        key: key.to_string(),
        body_hash: response.body_hash.into_owned(),
        status: response.status,
        content_type: response.content_type.into_owned(),
        body,
        expires_ms: 0,
    })
}

/// Version 1 took `context` later, optional: a build that predates it reads the tenant
/// and ignores the field (it then reserves a chained call's body only, as it did), so
/// the field needs no new version.
#[derive(Serialize, Deserialize)]
struct Owner<'a> {
    tenant: Cow<'a, str>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    context: Option<u64>,
}

/// `{"v":1,"tenant":..}`, with `"context":N` once a response's context size is known
/// (the object's id is in the record's key).
pub fn encode_owner(tenant: &str, context_tokens: Option<u64>) -> String {
    versioned(
        Record::Owner,
        &Owner {
            tenant: Cow::Borrowed(tenant),
            context: context_tokens,
        },
    )
}

/// The owning tenant and, when recorded, the context size. Version 0 was the bare name;
/// a versioned owner is a JSON object with a numeric `"v"` (config names no tenant like
/// that).
pub fn decode_owner(text: &str) -> Result<StoredOwner, UnknownFormat> {
    #[derive(Deserialize)]
    struct Version {
        v: u64,
    }
    let record = Record::Owner;
    let Some(Version { v }) = text
        .starts_with('{')
        .then(|| serde_json::from_str::<Version>(text).ok())
        .flatten()
    else {
        return Ok(StoredOwner {
            tenant: text.to_string(),
            context_tokens: None,
        });
    };
    match v {
        1 => {
            let owner = parse::<Owner<'_>>(record, text)?;
            Ok(StoredOwner {
                tenant: owner.tenant.into_owned(),
                context_tokens: owner.context,
            })
        }
        // 0 is the bare name: a JSON object naming it is no format Backstop wrote.
        v => Err(UnknownFormat::version(record, v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot() -> GuardSnapshot {
        GuardSnapshot {
            phase: Phase::Tripped,
            until_ms: 1_700_000_060_000,
            code: Some("loop_detected".into()),
            rule: Some("identical_request_limit".into()),
            evidence: Some("the same request was sent 4 times within 10m".into()),
            consecutive_failures: 2,
            recent: vec![(1_700_000_000_000, 0x594d_c199_7f11_1abb)],
            spend: vec![(1_700_000_000_000, 0.25)],
            transitions: 3,
            signature: None,
            restart: None,
        }
    }

    /// What version 1 of each record is, byte for byte: a change here is a change of
    /// format, which takes a new version (and a line in the release notes).
    #[test]
    fn version_1_of_each_record_is_pinned() {
        let snap = r#"{"v":1,"phase":"tripped","until_ms":1700000060000,"code":"loop_detected","rule":"identical_request_limit","evidence":"the same request was sent 4 times within 10m","consecutive_failures":2,"recent":[[1700000000000,6435012307588291259]],"spend":[[1700000000000,0.25]],"transitions":3}"#;
        assert_eq!(encode_snapshot(&snapshot()), snap);
        assert_eq!(decode_snapshot(snap), Ok(snapshot()));
        // A fleet trip adds its signature at the end; version 1 readers ignore it.
        let fleet = GuardSnapshot {
            rule: Some("fleet_pattern".into()),
            signature: Some(42),
            ..snapshot()
        };
        let text = encode_snapshot(&fleet);
        assert!(
            text.ends_with(r#""transitions":3,"signature":42}"#),
            "{text}"
        );
        assert_eq!(decode_snapshot(&text), Ok(fleet));

        let kept = GuardRecord {
            tenant: "acme".into(),
            session: "s1".into(),
            closed: false,
            until_ms: 1_700_000_060_000,
            code: "session_tripped".into(),
            rule: "max_consecutive_failures".into(),
            evidence: "5 requests in a row failed".into(),
            updated_ms: 1_700_000_000_000,
        };
        let text = r#"{"v":1,"closed":false,"until_ms":1700000060000,"code":"session_tripped","rule":"max_consecutive_failures","evidence":"5 requests in a row failed","updated_ms":1700000000000}"#;
        assert_eq!(encode_guard_record(&kept), text);
        assert_eq!(decode_guard_record("acme", "s1", text), Ok(kept));

        let response = StoredResponse {
            tenant: "acme".into(),
            key: "chat_completions:k1".into(),
            body_hash: "2cf24dba".into(),
            status: 200,
            content_type: "application/json".into(),
            body: b"{}".to_vec(),
            expires_ms: 0,
        };
        let text = r#"{"v":1,"body_hash":"2cf24dba","status":200,"content_type":"application/json","body":"e30="}"#;
        assert_eq!(encode_response(&response), text);
        let back = decode_response("acme", "chat_completions:k1", text).unwrap();
        assert_eq!(
            (back.body_hash, back.status, back.content_type, back.body),
            (
                "2cf24dba".into(),
                200,
                "application/json".into(),
                b"{}".to_vec()
            )
        );

        assert_eq!(encode_owner("acme", None), r#"{"v":1,"tenant":"acme"}"#);
        assert_eq!(
            decode_owner(r#"{"v":1,"tenant":"acme"}"#).unwrap().tenant,
            "acme"
        );
        assert_eq!(
            encode_owner("acme", Some(200_100)),
            r#"{"v":1,"tenant":"acme","context":200100}"#
        );
        assert_eq!(
            decode_owner(r#"{"v":1,"tenant":"acme","context":200100}"#).unwrap(),
            StoredOwner {
                tenant: "acme".into(),
                context_tokens: Some(200_100)
            }
        );
        // Written before the size was recorded: read, with no size.
        assert_eq!(
            decode_owner(r#"{"v":1,"tenant":"acme"}"#)
                .unwrap()
                .context_tokens,
            None
        );
    }

    /// Records written before formats had versions (as the release before this one
    /// wrote them) read as version 0.
    #[test]
    fn records_without_a_version_read_as_version_0() {
        let snap = r#"{"phase":"tripped","until_ms":1700000060000,"code":"loop_detected","rule":"identical_request_limit","evidence":"the same request was sent 4 times within 10m","consecutive_failures":2,"recent":[[1700000000000,6435012307588291259]],"spend":[[1700000000000,0.25]],"transitions":3}"#;
        assert_eq!(decode_snapshot(snap), Ok(snapshot()));

        let kept = decode_guard_record(
            "acme",
            "s1",
            r#"{"closed":true,"code":"session_tripped","evidence":"an operator closed this session","rule":"closed","until_ms":0,"updated_ms":1700000000000}"#,
        )
        .unwrap();
        assert!(kept.closed);
        assert_eq!((kept.rule.as_str(), kept.until_ms), ("closed", 0));

        let response = decode_response(
            "acme",
            "k",
            r#"{"body":"e30=","body_hash":"2cf24dba","content_type":"application/json","status":201}"#,
        )
        .unwrap();
        assert_eq!((response.status, response.body), (201, b"{}".to_vec()));

        assert_eq!(decode_owner("acme").unwrap().tenant, "acme");
        assert_eq!(decode_owner("{team}").unwrap().tenant, "{team}");
    }

    /// A newer version, or a record that does not parse, is refused: never read as a
    /// default (an active guard, no kept trip, a missing response, another owner).
    #[test]
    fn an_unknown_version_or_phase_is_refused() {
        let newer = |record| UnknownFormat::version(record, 99);
        assert_eq!(
            decode_snapshot(r#"{"v":99,"phase":"active"}"#),
            Err(newer(Record::GuardSnapshot))
        );
        let unknown_phase = decode_snapshot(
            r#"{"v":1,"phase":"dormant","until_ms":0,"code":null,"rule":null,"evidence":null,"consecutive_failures":0,"recent":[],"spend":[],"transitions":0}"#,
        )
        .unwrap_err();
        assert_eq!(unknown_phase.version, None);
        assert!(
            unknown_phase.detail.contains("unknown variant `dormant`"),
            "{unknown_phase}"
        );
        assert!(decode_snapshot("not json").is_err());
        assert_eq!(
            decode_guard_record("acme", "s1", r#"{"v":99,"closed":true}"#),
            Err(newer(Record::GuardRecord))
        );
        assert_eq!(
            decode_response("acme", "k", r#"{"v":99}"#).unwrap_err(),
            newer(Record::Idempotency)
        );
        // The claim marker is not a kept response.
        assert!(decode_response("acme", "k", "pending").is_err());
        assert_eq!(
            decode_owner(r#"{"v":99,"tenant":"acme"}"#),
            Err(newer(Record::Owner))
        );
        assert_eq!(
            decode_owner(r#"{"v":0,"tenant":"acme"}"#),
            Err(UnknownFormat::version(Record::Owner, 0))
        );
        assert!(decode_owner(r#"{"v":1}"#).is_err());
        assert_eq!(
            newer(Record::Owner).to_string(),
            "owner record of format version 99, which this build does not read (it reads versions 0 to 1): written by a newer Backstop?"
        );
    }

    /// The phases as stored are the names logs and metrics use.
    #[test]
    fn phases_are_stored_by_their_labels() {
        for phase in [
            Phase::Active,
            Phase::Recovering,
            Phase::Tripped,
            Phase::Probing,
            Phase::Closed,
        ] {
            assert_eq!(
                serde_json::to_string(&phase).unwrap(),
                format!("\"{}\"", phase.label())
            );
        }
    }

    /// Version 2, the form Redis keeps (the window beside the snapshot), byte for byte;
    /// and back to version 1, which is what every reader decodes.
    #[test]
    fn version_2_keeps_the_window_beside_the_snapshot() {
        let v1 = encode_snapshot(&GuardSnapshot {
            recent: vec![(1_700_000_000_000, 7), (1_700_000_000_001, 8)],
            ..snapshot()
        });
        let (v2, window) = to_beside(&v1).expect("version 1 text");
        assert_eq!(
            v2,
            r#"{"v":2,"phase":"tripped","until_ms":1700000060000,"code":"loop_detected","rule":"identical_request_limit","evidence":"the same request was sent 4 times within 10m","consecutive_failures":2,"recent":[],"spend":[[1700000000000,0.25]],"transitions":3}"#
        );
        assert_eq!(window, "[1700000000000,7],[1700000000001,8]");
        // Read back from Redis: the list's entries, joined by `;`.
        assert_eq!(from_beside(&v2, "1700000000000,7;1700000000001,8"), v1);
        let empty = encode_snapshot(&GuardSnapshot {
            recent: vec![],
            ..snapshot()
        });
        let (v2_empty, none) = to_beside(&empty).unwrap();
        assert_eq!(none, "");
        assert_eq!(from_beside(&v2_empty, ""), empty);
        // A version 1 state an older build wrote holds its own window; anything else
        // is left as it is, to be refused by the decoder.
        assert_eq!(from_beside(&v1, "1,2"), v1);
        assert_eq!(to_beside(r#"{"v":99,"phase":"hibernating"}"#), None);
        assert_eq!(
            decode_snapshot(&v2).map_err(|e| e.version),
            Err(Some(2)),
            "version 2 is never read without its window"
        );
        // The prefixes the scripts test for, as version 2 has them.
        assert!(v2_empty.starts_with(&beside_prefix(r#"{"v":1,"phase":"tripped","#)));
    }

    /// What a whole write sends to the scripts: its window's op and argument.
    #[test]
    fn a_whole_write_says_what_it_does_to_the_window() {
        let v1 = encode_snapshot(&snapshot());
        let append = WindowWrite::Append {
            at_ms: 1_700_000_000_500,
            request: 9,
            since_ms: 1_699_999_990_500,
        };
        let (state, op, arg) = beside_write(&v1, append, 3);
        assert!(state.starts_with(r#"{"v":2,"#));
        assert_eq!((op, arg.as_str()), ("a", "1700000000500,9,1699999990500"));
        assert_eq!(beside_write(&v1, WindowWrite::Keep, 3).1, "");
        // A state with no version yet replaces whatever is there with its own window.
        let (_, op, arg) = beside_write(&v1, append, 0);
        assert_eq!(
            (op, arg.as_str()),
            ("r", "[1700000000000,6435012307588291259]")
        );
        let (_, op, arg) = beside_write(&v1, WindowWrite::Replace, 5);
        assert_eq!(
            (op, arg.as_str()),
            ("r", "[1700000000000,6435012307588291259]")
        );
        // Text of another shape is kept as it is, with no window beside it.
        let odd = beside_write("odd", append, 3);
        assert_eq!(odd, ("odd".to_string(), "r", String::new()));
    }

    /// A fleet trip's parts (the counts go between them) in version 2.
    #[test]
    fn a_trips_parts_are_cut_from_version_2() {
        let text = encode_snapshot(&snapshot());
        let mark = "sent 4 times";
        let (a, b) = text.split_once(mark).unwrap();
        let parts = parts_beside(&[a.to_string(), b.to_string()]);
        assert_eq!(
            parts.join(mark),
            to_beside(&text).unwrap().0,
            "the parts joined are the whole state's version 2"
        );
    }
}
