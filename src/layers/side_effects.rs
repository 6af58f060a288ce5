//! Side effects committed once (inside validation, outside recovery): for a tenant with
//! `[tenants.side_effects]` and a call in a session, the results its conversation feeds
//! back for listed tools are journaled before it goes on ([`Journal::commit`]), and a
//! whole answer that proposes a committed call again (same tool, same canonical
//! arguments) is met as the tenant says (`on_repeat`):
//!
//! - `correct`: not passed on; one corrective attempt tells the model the call was made
//!   (with its result) and asks it to go on without repeating it; a second proposal is
//!   refused;
//! - `refuse`: 409 `duplicate_side_effect`, in the caller's API shape;
//! - `annotate`: passed on, marked `x-backstop-side-effect: duplicate; tool=NAME`.
//!
//! An agent that means to repeat names the tools in `x-backstop-allow-repeat`; a
//! session narrows its tenant's list with `x-backstop-side-effects`. A streamed answer
//! is passed on as it comes (its duplicates are not caught yet); its request's results
//! are journaled all the same. Tenants without the table pay nothing here.

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
    validation::{append_exchange, Format},
};

/// The caller's list of tools it means to call again.
pub const ALLOW_REPEAT: &str = "x-backstop-allow-repeat";
/// A session's own list of side-effecting tools, within its tenant's.
pub const SESSION_TOOLS: &str = "x-backstop-side-effects";
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

/// The first committed call an answer's listed calls repeat, and the listed calls that
/// are new.
struct Read<'a> {
    repeat: Option<(ToolCall, &'a Entry)>,
    deliberate: Vec<&'a Entry>,
    new: Vec<ToolCall>,
}

fn read<'a>(
    endpoint: Endpoint,
    answer: &Value,
    session: &'a Session,
    policy: &SideEffectPolicy,
    allowed: &[String],
) -> Read<'a> {
    let mut read = Read {
        repeat: None,
        deliberate: Vec::new(),
        new: Vec::new(),
    };
    for call in tool_calls::proposed(endpoint, answer) {
        if !policy.lists(&call.tool) {
            continue;
        }
        match session.committed(&call) {
            Some(entry) if allowed.contains(&call.tool) => read.deliberate.push(entry),
            Some(entry) => {
                if read.repeat.is_none() {
                    read.repeat = Some((call, entry));
                }
            }
            None => read.new.push(call),
        }
    }
    read
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
    append_exchange(Format::of(endpoint), &mut next, said, note);
    next
}

fn duplicate(call: &ToolCall, entry: &Entry) -> GatewayError {
    GatewayError::DuplicateSideEffect {
        tool: call.tool.clone(),
        call_id: entry.call_id.clone(),
        result: entry.result.clone(),
    }
}

fn mark(answered: &mut Answered, what: &str, tool: &str) {
    if let Ok(value) = HeaderValue::from_str(&format!("{what}; tool={tool}")) {
        answered.reply.headers.insert(SIDE_EFFECT, value);
    }
}

impl SideEffectsLayer {
    /// Journals what went wrong writing the journal: the request goes on (the guard
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
        let policy = match names(&call, SESSION_TOOLS) {
            Some(tools) => Arc::new(tenant_policy.narrowed(tools, None)),
            None => tenant_policy.clone(),
        };
        let allowed = names(&call, ALLOW_REPEAT).unwrap_or_default();
        let tenant = call.tenant.clone();
        let mut session = match self.journal.session(&tenant, &session_id).await {
            Ok(session) => session,
            Err(err) => {
                Self::unjournaled(&err, &tenant, &session_id);
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
            Err(err) => Self::unjournaled(&err, &tenant, &session_id),
        }
        if call.request.stream {
            return inner.oneshot(call).await;
        }
        call.keep_answer = true;
        let mut answered = inner.clone().oneshot(call.clone()).await?;
        // The tool of the repeat a corrective attempt was made for.
        let mut corrected: Option<String> = None;
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
            if !tool_calls::proposed(endpoint, answer)
                .iter()
                .any(|c| policy.lists(&c.tool))
            {
                if let Some(tool) = &corrected {
                    mark(&mut answered, "corrected", tool);
                }
                return Ok(answered);
            }
            // Read again: a result committed (on any replica) while this call was on its
            // way upstream is a side effect done before this answer is judged.
            match self.journal.session(&tenant, &session_id).await {
                Ok(fresh) => session = fresh,
                Err(err) => Self::unjournaled(&err, &tenant, &session_id),
            }
            let read = read(endpoint, answer, &session, &policy, &allowed);
            for entry in &read.deliberate {
                count("allowed");
                if let Err(err) = self
                    .journal
                    .repeated(&tenant, &session_id, entry, true, policy.max_entries)
                    .await
                {
                    Self::unjournaled(&err, &tenant, &session_id);
                }
            }
            if !read.new.is_empty() {
                let new: Vec<&ToolCall> = read.new.iter().collect();
                if let Err(err) = self
                    .journal
                    .propose(&tenant, &session_id, &session, &policy, &new)
                    .await
                {
                    Self::unjournaled(&err, &tenant, &session_id);
                }
            }
            let Some((repeat, entry)) = read.repeat else {
                if let Some(tool) = &corrected {
                    mark(&mut answered, "corrected", tool);
                }
                return Ok(answered);
            };
            if let Err(err) = self
                .journal
                .repeated(&tenant, &session_id, entry, false, policy.max_entries)
                .await
            {
                Self::unjournaled(&err, &tenant, &session_id);
            }
            tracing::warn!(
                tenant = &*tenant,
                session = &*session_id,
                tool = repeat.tool,
                earlier = entry.call_id,
                on_repeat = policy.on_repeat.as_str(),
                corrected = corrected.is_some(),
                "an answer proposed a committed side effect again"
            );
            match policy.on_repeat {
                OnRepeat::Annotate => {
                    count("annotated");
                    mark(&mut answered, "duplicate", &repeat.tool);
                    return Ok(answered);
                }
                OnRepeat::Correct if corrected.is_none() => {
                    count("corrected");
                    corrected = Some(repeat.tool.clone());
                    let mut trail = std::mem::take(&mut answered.trail);
                    trail.steps.push(Step::Repeat {
                        tool: repeat.tool.as_str().into(),
                        call: entry.call_id.as_str().into(),
                    });
                    let json =
                        correction(endpoint, &call.request.json, &repeat, entry, policy.record);
                    match inner.clone().oneshot(call.with_json(json)).await {
                        Ok(mut again) => {
                            trail.then(std::mem::take(&mut again.trail));
                            again.trail = trail;
                            answered = again;
                        }
                        Err(mut failed) => {
                            trail.then(std::mem::take(&mut failed.trail));
                            failed.trail = trail;
                            return Err(failed);
                        }
                    }
                }
                OnRepeat::Correct | OnRepeat::Refuse => {
                    count("refused");
                    return Err(Unanswered {
                        error: duplicate(&repeat, entry),
                        trail: std::mem::take(&mut answered.trail),
                    });
                }
            }
        }
    }
}
