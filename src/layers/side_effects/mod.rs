//! Side effects committed once (inside validation, outside recovery): for a tenant with
//! `[tenants.side_effects]` and a call in a session, the results its conversation feeds
//! back for listed tools are journaled before it goes on ([`Journal::commit`]), and a
//! whole answer that proposes a committed call again (same tool, same canonical
//! arguments) is met as the tenant says (`on_repeat`):
//!
//! - `correct`: not passed on; one corrective attempt tells the model the call was made
//!   (with its result) and asks it to go on without repeating it (one per committed call
//!   the answers repeat, at most [`MAX_CORRECTIONS`]); the same call proposed again
//!   after its correction is refused;
//! - `refuse`: 409 `duplicate_side_effect`, in the caller's API shape;
//! - `annotate`: passed on, marked `x-backstop-side-effect: duplicate; tool=NAME`.
//!
//! An agent that means to repeat names the tools in `x-backstop-allow-repeat`; a
//! session narrows its tenant's list with `x-backstop-side-effects`, and its
//! `on_repeat` with `x-backstop-side-effects-on-repeat` (only ever stricter). A streamed answer
//! is watched as it flows ([`stream`]): a listed call is held until its arguments are
//! complete. Tenants without the table pay nothing here.

use std::{collections::HashMap, sync::Arc};

use http::HeaderValue;
use serde_json::{Map, Value};
use tower::{Layer, Service, ServiceExt};

use super::{
    context::Call,
    recovery::{Answered, Unanswered},
    Middleware, Stack,
};
use crate::{
    api::{
        request::{noted, Place},
        tool_calls::{self, ToolCall},
        Endpoint,
    },
    config::Config,
    error::GatewayError,
    policy::{
        side_effects::{canonical_args, OnRepeat, Record, SideEffectPolicy},
        trail::Step,
    },
    state::journal::{Entry, Journal, Session},
    telemetry::Trail,
    upstream::ReplyBody,
    validation::append_exchange,
};

/// The caller's list of tools it means to call again.
pub const ALLOW_REPEAT: &str = "x-backstop-allow-repeat";
/// A session's own list of side-effecting tools, within its tenant's.
pub const SESSION_TOOLS: &str = "x-backstop-side-effects";
/// A session's own `on_repeat`, if stricter than its tenant's (`refuse` is the strictest,
/// then `correct`, then `annotate`).
pub const SESSION_ON_REPEAT: &str = "x-backstop-side-effects-on-repeat";
/// What was done about a repeated side effect.
pub const SIDE_EFFECT: &str = "x-backstop-side-effect";

#[derive(Clone)]
pub struct SideEffectsLayer {
    policies: Arc<HashMap<String, Arc<SideEffectPolicy>>>,
    journal: Arc<Journal>,
}

impl SideEffectsLayer {
    pub fn new(config: &Config, journal: Arc<Journal>) -> Self {
        let policies = config
            .tenants
            .iter()
            .filter_map(|t| {
                let policy = t.side_effects.as_ref()?.policy();
                Some((t.name.clone(), Arc::new(policy)))
            })
            .collect();
        SideEffectsLayer {
            policies: Arc::new(policies),
            journal,
        }
    }
}

pub type SideEffects<S> = Stack<SideEffectsLayer, S>;

impl<S> Layer<S> for SideEffectsLayer {
    type Service = SideEffects<S>;
    fn layer(&self, inner: S) -> SideEffects<S> {
        Stack::new(self.clone(), inner)
    }
}

fn count(outcome: &'static str) {
    metrics::counter!("backstop_side_effects_total", "outcome" => outcome).increment(1);
}

/// A comma-separated header's names.
fn names(call: &Call, header: &str) -> Option<Vec<String>> {
    let value = call.headers.get(header)?.to_str().ok()?;
    Some(
        value
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect(),
    )
}

mod stream;

/// What judging a streamed answer's calls needs: the session's rule and journal, and
/// what the caller allowed. Owned, so that it goes with the stream's body.
pub(super) struct Watch {
    policy: Arc<SideEffectPolicy>,
    allowed: Vec<String>,
    session: Session,
    journal: Arc<Journal>,
    tenant: Arc<str>,
    session_id: Arc<str>,
    /// The journal was read again since the call went upstream.
    fresh: bool,
}

/// How one listed call of a streamed answer was judged.
pub(super) enum Judged {
    /// Not committed before: journaled as proposed.
    New,
    /// A repeat the caller declared.
    Deliberate,
    /// A repeat of this committed entry.
    Repeat(Entry),
}

/// Judges one listed call, journaling what it finds (the journal read again for the
/// first: a commit made anywhere while the call was upstream counts).
async fn judge(watch: &mut Watch, call: &ToolCall) -> Judged {
    let Watch {
        policy,
        allowed,
        session,
        journal,
        tenant,
        session_id,
        fresh,
    } = watch;
    if !*fresh {
        *fresh = true;
        match journal.session(tenant, session_id).await {
            Ok(read) => *session = read,
            Err(err) => SideEffectsLayer::unjournaled(&err, tenant, session_id),
        }
    }
    match session.committed(call).cloned() {
        Some(entry) => {
            let deliberate = allowed.contains(&call.tool);
            if let Err(err) = journal
                .repeated(
                    tenant,
                    session_id,
                    session,
                    &entry.call_id,
                    deliberate,
                    policy.max_entries,
                )
                .await
            {
                SideEffectsLayer::unjournaled(&err, tenant, session_id);
            }
            if deliberate {
                count("allowed");
                Judged::Deliberate
            } else {
                Judged::Repeat(entry)
            }
        }
        None => {
            if let Err(err) = journal
                .propose(tenant, session_id, session, policy, &[call])
                .await
            {
                SideEffectsLayer::unjournaled(&err, tenant, session_id);
            }
            Judged::New
        }
    }
}

/// The request again, with the model's repeat and a note after it: the call was made,
/// here is its result, go on without it.
fn correction(
    endpoint: Endpoint,
    request: &Map<String, Value>,
    call: &ToolCall,
    entry: &Entry,
    record: Record,
) -> Map<String, Value> {
    let mut next = request.clone();
    let (args, result) = match record {
        Record::Full => (
            format!(" with the arguments {}", canonical_args(&call.args)),
            format!(
                "it returned: {}",
                entry.result.as_deref().unwrap_or("(no result kept)")
            ),
        ),
        Record::Hash => (
            " with the same arguments as an earlier call".to_string(),
            "it succeeded".to_string(),
        ),
    };
    let said = format!("(I was about to call `{}`{args} again.)", call.tool);
    let note = format!(
        "Do not call `{tool}` with these arguments again. That call was already made earlier in this session (call {id}) and its side effect is done; {result}. It was not executed a second time. Continue from its result without repeating it.",
        tool = call.tool,
        id = entry.call_id,
    );
    append_exchange(endpoint.wire(), &mut next, said, note);
    next
}

/// `on_unavailable = "closed"`: the request is refused before any upstream call, since
/// what it carries (or what its answer repeats) could not be journaled.
fn unavailable(err: &crate::store::StoreError) -> Unanswered {
    Unanswered {
        error: GatewayError::StoreUnavailable {
            detail: format!("the side-effect journal cannot be read or written: {err}"),
        },
        trail: Default::default(),
    }
}

fn duplicate(call: &ToolCall, entry: &Entry) -> GatewayError {
    GatewayError::DuplicateSideEffect {
        tool: call.tool.clone(),
        call_id: entry.call_id.clone(),
        result: entry.result.clone(),
    }
}

/// The most committed calls a restoring note lists (the newest).
const RESTORED_ENTRIES: usize = 20;

/// `restore = "note"`: a conversation that shows none of the session's committed calls
/// (a replanned one; a Responses chain on `previous_response_id` is not) is told of them,
/// so the model need not propose them at all: a note in the request's own place for
/// instructions (a chat system message after the leading ones, Anthropic's `system`,
/// the Responses `instructions`). How many it lists; 0: the request is as it came.
fn restore(endpoint: Endpoint, call: &mut Call, session: &Session, calls: &[ToolCall]) -> usize {
    let committed: Vec<&Entry> = session
        .entries
        .iter()
        .filter(|e| e.is_committed())
        .collect();
    let replanned = !committed.is_empty()
        && !call.request.json.contains_key("previous_response_id")
        && !calls
            .iter()
            .any(|c| committed.iter().any(|e| e.call_id == c.id));
    if !replanned {
        return 0;
    }
    let listed = &committed[committed.len().saturating_sub(RESTORED_ENTRIES)..];
    let lines: Vec<String> = listed
        .iter()
        .map(|e| match (&e.args, &e.result) {
            (Some(args), Some(result)) => {
                format!(
                    "- `{}` with {args} (call {}): it returned {result}",
                    e.tool, e.call_id
                )
            }
            _ => format!("- `{}` (call {}): it succeeded", e.tool, e.call_id),
        })
        .collect();
    let note = format!(
        "Earlier in this session these actions were already carried out; their side effects are done and must not be repeated:\n{}",
        lines.join("\n")
    );
    let json = noted(endpoint, &call.request.json, &note, Place::Leading);
    *call = call.with_json(json);
    count("restored");
    listed.len()
}

/// The answer's mark: the tools corrective attempts were made for, else how many
/// committed calls a restoring note listed.
fn finish(answered: &mut Answered, corrections: &Corrections, restored: usize) {
    if corrections.made.is_empty() && restored > 0 {
        mark(answered, &format!("restored; entries={restored}"));
    }
    mark_corrected(answered, &corrections.made);
}

/// Corrective attempts one request may make: one per committed call its answers repeat.
const MAX_CORRECTIONS: usize = 8;

/// The corrections of one request: the committed calls a corrective attempt was made for
/// (with their tools), and the request the last one sent (each correction adds to it).
#[derive(Default)]
pub(super) struct Corrections {
    made: Vec<(String, String)>,
    sent: Option<Map<String, Value>>,
}

impl Corrections {
    /// The corrective attempt for `repeat` of `entry`, when `policy` corrects and this
    /// call was not corrected already (nor the request's corrections used up).
    fn next(
        &mut self,
        call: &Call,
        repeat: &ToolCall,
        entry: &Entry,
        policy: &SideEffectPolicy,
    ) -> Option<Call> {
        if policy.on_repeat != OnRepeat::Correct
            || self.made.len() >= MAX_CORRECTIONS
            || self.made.iter().any(|(id, _)| *id == entry.call_id)
        {
            return None;
        }
        count("corrected");
        self.made.push((entry.call_id.clone(), repeat.tool.clone()));
        let base = self.sent.as_ref().unwrap_or(&call.request.json);
        let json = correction(call.endpoint(), base, repeat, entry, policy.record);
        self.sent = Some(json.clone());
        Some(call.with_json(json))
    }
}

/// `result`, after what recovery did before it (`trail`, with the repeat that led to it).
// The recovery service's own result, passed through as it came: not boxed here.
#[allow(clippy::result_large_err)]
fn after(trail: &mut Trail, result: Result<Answered, Unanswered>) -> Result<Answered, Unanswered> {
    let mut trail = std::mem::take(trail);
    match result {
        Ok(mut again) => {
            trail.then(std::mem::take(&mut again.trail));
            again.trail = trail;
            Ok(again)
        }
        Err(mut failed) => {
            trail.then(std::mem::take(&mut failed.trail));
            failed.trail = trail;
            Err(failed)
        }
    }
}

/// The step a correction of `repeat` (of `entry`) adds to the trail.
fn repeat_step(repeat: &ToolCall, entry: &Entry) -> Step {
    Step::Repeat {
        tool: repeat.tool.as_str().into(),
        call: entry.call_id.as_str().into(),
    }
}

/// Logs a repeat found in an answer.
fn found(watch: &Watch, repeat: &ToolCall, entry: &Entry, streamed: bool) {
    tracing::warn!(
        tenant = &*watch.tenant,
        session = &*watch.session_id,
        tool = repeat.tool,
        earlier = entry.call_id,
        on_repeat = watch.policy.on_repeat.as_str(),
        streamed,
        "an answer proposed a committed side effect again"
    );
}

/// Marks an answer that corrective attempts led to with the tools they were made for.
fn mark_corrected(answered: &mut Answered, corrected: &[(String, String)]) {
    if corrected.is_empty() {
        return;
    }
    let mut tools: Vec<&str> = corrected.iter().map(|(_, tool)| tool.as_str()).collect();
    tools.sort_unstable();
    tools.dedup();
    mark(answered, &format!("corrected; tool={}", tools.join(",")));
}

fn mark(answered: &mut Answered, value: &str) {
    if let Ok(value) = HeaderValue::from_str(value) {
        answered.reply.headers.insert(SIDE_EFFECT, value);
    }
}

impl SideEffectsLayer {
    /// Logs and counts a journal the store could not read or write: the request goes on (the guard
    /// protects against loops, the journal against repeats; neither blocks an agent
    /// because the store is down), counted.
    fn unjournaled(err: &crate::store::StoreError, tenant: &str, session: &str) {
        tracing::error!(tenant, session, error = %err, "side-effect journal unavailable: this request's results are not journaled");
        count("unjournaled");
    }
}

impl<S> Middleware<S, Call> for SideEffectsLayer
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    type Inner = Call;
    type Response = Answered;
    type Error = Unanswered;

    async fn call(&self, inner: S, mut call: Call) -> Result<Answered, Unanswered> {
        let endpoint = call.endpoint();
        let listed = matches!(
            endpoint,
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses
        );
        let (Some(tenant_policy), Some(session_id), true) = (
            self.policies.get(&*call.tenant),
            call.session.clone(),
            listed,
        ) else {
            return inner.oneshot(call).await;
        };
        let on_repeat = names(&call, SESSION_ON_REPEAT)
            .and_then(|v| v.first().and_then(|r| OnRepeat::parse(r)));
        let policy = match (names(&call, SESSION_TOOLS), on_repeat) {
            (None, None) => tenant_policy.clone(),
            (tools, on_repeat) => {
                let tools = tools.unwrap_or_else(|| tenant_policy.tools.clone());
                Arc::new(tenant_policy.narrowed(tools, on_repeat))
            }
        };
        let allowed = names(&call, ALLOW_REPEAT).unwrap_or_default();
        let tenant = call.tenant.clone();
        let mut session = match self.journal.session(&tenant, &session_id).await {
            Ok(session) => session,
            Err(err) => {
                Self::unjournaled(&err, &tenant, &session_id);
                if policy.fail_closed {
                    return Err(unavailable(&err));
                }
                Session::default()
            }
        };
        let (calls, results) = tool_calls::conversation(endpoint, &call.request.json);
        match self
            .journal
            .commit(
                &tenant,
                &session_id,
                &mut session,
                &policy,
                (&calls, &results),
            )
            .await
        {
            Ok(written) => {
                for entry in &written {
                    count(if entry.is_committed() {
                        "committed"
                    } else {
                        "failed"
                    });
                }
            }
            Err(err) => {
                Self::unjournaled(&err, &tenant, &session_id);
                if policy.fail_closed {
                    return Err(unavailable(&err));
                }
            }
        }
        let restored = if policy.restore {
            restore(endpoint, &mut call, &session, &calls)
        } else {
            0
        };
        let watch = Watch {
            policy,
            allowed,
            session,
            journal: self.journal.clone(),
            tenant,
            session_id,
            fresh: false,
        };
        if call.request.stream {
            return streamed(inner, call, watch, restored).await;
        }
        whole(inner, call, watch, restored).await
    }
}

/// A whole answer: each listed call it proposes judged ([`judge`]); the first repeat is
/// met as `on_repeat` says, a corrective attempt's answer judged the same way.
async fn whole<S>(
    inner: S,
    mut call: Call,
    mut watch: Watch,
    restored: usize,
) -> Result<Answered, Unanswered>
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let endpoint = call.endpoint();
    call.keep_answer = true;
    let mut answered = inner.clone().oneshot(call.clone()).await?;
    let mut corrections = Corrections::default();
    loop {
        let Some(answer) = answered
            .reply
            .view
            .as_ref()
            .and_then(|v| v.json.as_ref())
            .filter(|_| answered.reply.status.is_success())
        else {
            return Ok(answered);
        };
        let listed: Vec<ToolCall> = tool_calls::proposed(endpoint, answer)
            .into_iter()
            .filter(|c| watch.policy.lists(&c.tool))
            .collect();
        // Each answer reads the journal again: a result committed (on any replica) while
        // its call was on its way upstream is a side effect done before it is judged.
        watch.fresh = false;
        let mut repeat = None;
        for proposed in listed {
            if let Judged::Repeat(entry) = judge(&mut watch, &proposed).await {
                repeat.get_or_insert((proposed, entry));
            }
        }
        let Some((repeat, entry)) = repeat else {
            finish(&mut answered, &corrections, restored);
            return Ok(answered);
        };
        found(&watch, &repeat, &entry, false);
        if watch.policy.on_repeat == OnRepeat::Annotate {
            count("annotated");
            mark(&mut answered, &format!("duplicate; tool={}", repeat.tool));
            return Ok(answered);
        }
        let Some(again) = corrections.next(&call, &repeat, &entry, &watch.policy) else {
            count("refused");
            return Err(Unanswered {
                error: duplicate(&repeat, &entry),
                trail: std::mem::take(&mut answered.trail),
            });
        };
        answered.trail.steps.push(repeat_step(&repeat, &entry));
        answered = after(&mut answered.trail, inner.clone().oneshot(again).await)?;
    }
}

/// A streamed call: its answer watched ([`stream`]); a repeat before the answer begins
/// is corrected (streaming the corrective attempt's answer instead) or refused with a
/// plain 409; one after it is corrected following on, or ends the stream with an error
/// event.
async fn streamed<S>(
    inner: S,
    call: Call,
    mut watch: Watch,
    restored: usize,
) -> Result<Answered, Unanswered>
where
    S: Service<Call, Response = Answered, Error = Unanswered> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let endpoint = call.endpoint();
    let mut answered = inner.clone().oneshot(call.clone()).await?;
    let mut corrections = Corrections::default();
    loop {
        if !answered.reply.status.is_success() {
            return Ok(answered);
        }
        let body = match std::mem::replace(
            &mut answered.reply.body,
            ReplyBody::Full(bytes::Bytes::new()),
        ) {
            ReplyBody::Stream(body) => body,
            whole => {
                answered.reply.body = whole;
                return Ok(answered);
            }
        };
        // Each answer reads the journal again, as a whole one does.
        watch.fresh = false;
        let mut reader = stream::Reader::new(endpoint, body);
        let repeat = match reader.until_found(&mut watch).await {
            stream::Found::Begun => {
                finish(&mut answered, &corrections, restored);
                let corrector = stream::Corrector {
                    inner: inner.clone(),
                    call: call.clone(),
                    corrections,
                };
                answered.reply.body = ReplyBody::Stream(stream::body(reader, watch, corrector));
                return Ok(answered);
            }
            stream::Found::Repeat(repeat) => repeat,
        };
        let (repeat, entry) = (&repeat.call, &repeat.entry);
        found(&watch, repeat, entry, true);
        let Some(again) = corrections.next(&call, repeat, entry, &watch.policy) else {
            count("refused");
            return Err(Unanswered {
                error: duplicate(repeat, entry),
                trail: std::mem::take(&mut answered.trail),
            });
        };
        answered.trail.steps.push(repeat_step(repeat, entry));
        answered = after(&mut answered.trail, inner.clone().oneshot(again).await)?;
    }
}
