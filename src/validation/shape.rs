//! Static checks on a JSON Schema before `jsonschema` compiles it: the shapes that
//! jsonschema 0.33 compiles happily but cannot validate with bounded time and memory.
//!
//! - **Reference cycles that consume no input** (`{"allOf":[{"$ref":"#"}]}`): validating
//!   any instance recurses (and lazily compiles) without end until the stack overflows
//!   or memory runs out, which aborts the whole process. The graph checked has an edge
//!   from a subschema to every subschema applied to the *same* instance: the items of
//!   `allOf`/`anyOf`/`oneOf`, `not`, `if`/`then`/`else`, the values of
//!   `dependentSchemas` (and draft-7 `dependencies`), and the targets of `$ref`,
//!   `$dynamicRef` and `$recursiveRef`. Keywords that descend into the instance
//!   (`properties`, `items`, ...) consume input and add no edge, so recursive tree
//!   schemas pass. References are resolved by `referencing`, the resolver jsonschema
//!   itself uses, so `#`, JSON pointers, anchors and embedded `$id`s mean here exactly
//!   what they mean there; a reference it cannot resolve adds no edge (compilation
//!   rejects it). A subschema whose own `$ref`/`$dynamicRef` points at itself is let
//!   through: jsonschema drops that edge (`{"$ref":"#"}` validates fine).
//! - **Recursion that reaches one value along two paths**
//!   (`{"allOf":[{"items":{"$ref":"#"}},{"items":{"$ref":"#"}}]}`): no in-place cycle,
//!   but each level of an answer's nesting doubles the subschemas jsonschema compiles
//!   and evaluates; 22 nested arrays exhausted 3 GB. Found as the exponential ambiguity
//!   of the automaton whose states are subschemas and whose letters are instance steps
//!   (array element, property name), so a JSON-value schema (`items` and
//!   `additionalProperties` both back to the root) or a binary tree still passes.
//! - **Fan-out**: in-place applicators nest into a DAG with exponentially many paths
//!   (`d0 = allOf[d1, d1]`, `d1 = allOf[d2, d2]`, ...): 1.5 KB that keeps a core busy for
//!   minutes per instance. Limited by `validation.max_schema_fanout`, the number of
//!   subschemas applied to one instance value.
//! - **Depth and keyword paths**: the work of compiling one schema. Limited by
//!   `validation.max_schema_depth` (JSON nesting) and `validation.max_schema_paths`
//!   (distinct keyword sequences, `/properties/items/anyOf/...`). Under jsonschema 0.33
//!   these limits also bounded a leak, per schema only: its process-wide meta-schema
//!   validator grew by a few MB for every new keyword sequence it met and kept them for
//!   the process's life (300 requests of new shapes held 1.5 GB). jsonschema 0.61's
//!   does not grow (`tests/it/hardening.rs`, `schemas_of_new_shapes_...`).

use std::collections::{HashMap, HashSet};

use referencing::{Draft, Registry, Resolver};
use serde_json::Value;

/// The structural limits of one schema (`[validation]` keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShapeLimits {
    pub max_depth: usize,
    pub max_paths: usize,
    pub max_fanout: u64,
}

/// Checks `schema` against `limits` and for in-place reference cycles; the error names
/// the limit key and the figures, or the cycle by JSON pointer.
pub fn check(schema: &Value, limits: &ShapeLimits) -> Result<Checked, String> {
    let depth = depth(schema);
    if depth > limits.max_depth {
        return Err(format!(
            "the schema nests {depth} levels deep; the limit (validation.max_schema_depth) is {}",
            limits.max_depth
        ));
    }
    let paths = keyword_paths(schema, limits.max_paths);
    if paths > limits.max_paths {
        return Err(format!(
            "the schema has more than {} distinct keyword paths (validation.max_schema_paths)",
            limits.max_paths
        ));
    }
    let Some(graph) = Graph::of(schema) else {
        // Not resolvable as a document: compilation reports why.
        return Ok(Checked { recursive: false });
    };
    if let Some(cycle) = graph.cycle() {
        return Err(format!(
            "the schema has a reference cycle that consumes no input: {}",
            cycle.join(" -> ")
        ));
    }
    let fanout = graph.max_fanout();
    if fanout > limits.max_fanout {
        return Err(format!(
            "the schema applies {} subschemas to one value; the limit (validation.max_schema_fanout) is {}",
            if fanout == u64::MAX {
                "more than 2^64".to_string()
            } else {
                fanout.to_string()
            },
            limits.max_fanout
        ));
    }
    let recursive = graph.recursion().map_err(|at| {
        format!(
            "the schema's recursion through {at} reaches the same part of a value along more than one path, so validation doubles with each level of nesting"
        )
    })?;
    Ok(Checked { recursive })
}

/// What [`check`] learnt of a schema it let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checked {
    /// Validating may compile further copies of it, one per level of an answer's nesting.
    pub recursive: bool,
}

/// The checks for a route's `response_schema`, which the operator wrote: no size limits,
/// but nothing that would crash or stall validation either.
pub fn check_operator_schema(schema: &Value) -> Result<(), String> {
    let limits = ShapeLimits {
        max_depth: usize::MAX,
        max_paths: usize::MAX,
        max_fanout: 1 << 16,
    };
    check(schema, &limits).map(|_| ())
}

/// The first in-place reference cycle, as JSON pointers (`# -> #/allOf/0 -> #`).
pub fn find_cycle(schema: &Value) -> Option<String> {
    Graph::of(schema)?.cycle().map(|c| c.join(" -> "))
}

/// JSON nesting depth: a scalar is 0, `{}` is 1, `{"not": {}}` is 2.
pub fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Keywords whose value is one subschema applied to the same instance.
const IN_PLACE_ONE: &[&str] = &["not", "if", "then", "else"];
/// Keywords whose value is an array of subschemas applied to the same instance.
const IN_PLACE_LIST: &[&str] = &["allOf", "anyOf", "oneOf"];
/// Keywords whose value is a map of subschemas applied to the same instance.
const IN_PLACE_MAP: &[&str] = &["dependentSchemas", "dependencies"];
/// Keywords whose subschemas apply to parts of the instance (or are only definitions).
const DESCEND_ONE: &[&str] = &[
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
];
const DESCEND_LIST: &[&str] = &["prefixItems", "items"];
const DESCEND_MAP: &[&str] = &["properties", "patternProperties", "$defs", "definitions"];

/// How a subschema relates to the one holding it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Link {
    /// Applied to the same instance value.
    InPlace,
    /// Applied to a part of the instance.
    PathStep(PathStep),
    /// Not applied by itself (`$defs`, `contentSchema`, `propertyNames`: a property name
    /// is a string, which no keyword descends into further).
    Other,
}

/// Which part of the instance a descending keyword applies its subschema to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum PathStep {
    /// Every array element (`items`, `contains`, ...).
    Element,
    /// Array element `i` (`prefixItems`, draft-7 array `items`).
    Index(usize),
    /// The property `name` (`properties`).
    Name(String),
    /// Any property (`patternProperties`, `unevaluatedProperties`).
    AnyName,
    /// Any property but these (`additionalProperties` beside `properties`).
    NameNotIn(Vec<String>),
}

impl PathStep {
    /// Whether both can apply to one and the same child of an instance.
    fn overlaps(&self, other: &PathStep) -> bool {
        use PathStep::*;
        match (self, other) {
            (Element, Element) | (Element, Index(_)) | (Index(_), Element) => true,
            (Index(a), Index(b)) => a == b,
            (Name(a), Name(b)) => a == b,
            (AnyName, Name(_) | AnyName | NameNotIn(_))
            | (Name(_) | NameNotIn(_), AnyName)
            | (NameNotIn(_), NameNotIn(_)) => true,
            (Name(a), NameNotIn(names)) | (NameNotIn(names), Name(a)) => !names.contains(a),
            _ => false,
        }
    }
}

/// Every subschema directly under `schema`, with the keyword it sits under and how it
/// applies.
fn children(schema: &serde_json::Map<String, Value>) -> Vec<(&str, &Value, Link)> {
    let mut out = Vec::new();
    for (keyword, value) in schema {
        let kw = keyword.as_str();
        let in_place =
            IN_PLACE_ONE.contains(&kw) || IN_PLACE_LIST.contains(&kw) || IN_PLACE_MAP.contains(&kw);
        let link = |i: usize, name: &str| -> Link {
            if in_place {
                return Link::InPlace;
            }
            match kw {
                "items" if value.is_array() => Link::PathStep(PathStep::Index(i)),
                "prefixItems" => Link::PathStep(PathStep::Index(i)),
                "items" | "additionalItems" | "contains" | "unevaluatedItems" => {
                    Link::PathStep(PathStep::Element)
                }
                "properties" => Link::PathStep(PathStep::Name(name.to_string())),
                "patternProperties" | "unevaluatedProperties" => Link::PathStep(PathStep::AnyName),
                "additionalProperties" => Link::PathStep(PathStep::NameNotIn(
                    schema
                        .get("properties")
                        .and_then(Value::as_object)
                        .map(|p| p.keys().cloned().collect())
                        .unwrap_or_default(),
                )),
                _ => Link::Other,
            }
        };
        match value {
            Value::Object(_) | Value::Bool(_)
                if IN_PLACE_ONE.contains(&kw) || DESCEND_ONE.contains(&kw) =>
            {
                out.push((kw, value, link(0, "")));
            }
            Value::Array(items) if IN_PLACE_LIST.contains(&kw) || DESCEND_LIST.contains(&kw) => {
                out.extend(
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, item)| (kw, item, link(i, ""))),
                );
            }
            Value::Object(map) if IN_PLACE_MAP.contains(&kw) || DESCEND_MAP.contains(&kw) => {
                out.extend(
                    map.iter()
                        // Draft-7 `dependencies` also holds arrays of property names.
                        .filter(|(_, v)| v.is_object() || v.is_boolean())
                        .map(|(name, v)| (kw, v, link(0, name))),
                );
            }
            _ => {}
        }
    }
    out
}

/// The number of distinct keyword sequences from the root to a subschema, property names
/// and indices left out (`/properties/items/anyOf`), counted up to `cap + 1`.
pub fn keyword_paths(schema: &Value, cap: usize) -> usize {
    fn walk(schema: &Value, path: &str, seen: &mut HashSet<String>, cap: usize) {
        let Value::Object(map) = schema else { return };
        for (keyword, child, _) in children(map) {
            if seen.len() > cap {
                return;
            }
            let path = format!("{path}/{keyword}");
            walk(child, &path, seen, cap);
            seen.insert(path);
        }
    }
    let mut seen = HashSet::new();
    walk(schema, "", &mut seen, cap);
    seen.len()
}

/// Subschemas (by address in the registry's copy of the document) and the in-place
/// edges between them.
struct Graph {
    names: Vec<String>,
    edges: Vec<Vec<usize>>,
    /// Descending edges: the part of the instance, and the subschema applied to it.
    steps: Vec<Vec<(PathStep, usize)>>,
}

/// jsonschema's base URI for a schema without `$id`.
const DEFAULT_BASE: &str = "json-schema:///";

struct Walk<'r> {
    ids: HashMap<*const Value, usize>,
    pointers: HashMap<*const Value, String>,
    names: Vec<String>,
    edges: Vec<Vec<usize>>,
    steps: Vec<Vec<(PathStep, usize)>>,
    queue: Vec<(usize, &'r Value, Resolver<'r>, Draft)>,
    dynamic_anchors: HashMap<String, Vec<usize>>,
    recursive_anchors: Vec<usize>,
    dynamic_refs: Vec<(usize, String)>,
    recursive_refs: Vec<usize>,
}

impl<'r> Walk<'r> {
    fn node(
        &mut self,
        value: &'r Value,
        resolver: Resolver<'r>,
        draft: Draft,
        name: &str,
    ) -> usize {
        let address = value as *const Value;
        if let Some(id) = self.ids.get(&address) {
            return *id;
        }
        let id = self.names.len();
        self.ids.insert(address, id);
        self.names.push(
            self.pointers
                .get(&address)
                .cloned()
                .unwrap_or_else(|| name.to_string()),
        );
        self.edges.push(Vec::new());
        self.steps.push(Vec::new());
        self.queue.push((id, value, resolver, draft));
        id
    }

    fn visit(&mut self, id: usize, value: &'r Value, resolver: Resolver<'r>, draft: Draft) {
        let Value::Object(schema) = value else { return };
        // A `$schema` this crate cannot name keeps the draft the walk is in.
        let draft = match draft.detect(value) {
            Draft::Unknown => draft,
            detected => detected,
        };
        let resolver = resolver
            .in_subresource(draft.create_resource_ref(value))
            .unwrap_or(resolver);
        let name = self.names[id].clone();
        // Drafts 4 to 7 ignore every keyword beside `$ref`.
        let legacy_ref = matches!(draft, Draft::Draft4 | Draft::Draft6 | Draft::Draft7)
            && schema.get("$ref").is_some_and(Value::is_string);
        if !legacy_ref {
            for (keyword, child, link) in children(schema) {
                let child_name = format!("{name}/{keyword}");
                let child = self.node(child, resolver.clone(), draft, &child_name);
                match link {
                    Link::InPlace => self.edges[id].push(child),
                    Link::PathStep(step) => self.steps[id].push((step, child)),
                    Link::Other => {}
                }
            }
            if let Some(anchor) = schema.get("$dynamicAnchor").and_then(Value::as_str) {
                self.dynamic_anchors
                    .entry(anchor.to_string())
                    .or_default()
                    .push(id);
            }
            if schema.get("$recursiveAnchor") == Some(&Value::Bool(true)) {
                self.recursive_anchors.push(id);
            }
        }
        for keyword in ["$ref", "$dynamicRef", "$recursiveRef"] {
            if legacy_ref && keyword != "$ref" {
                continue;
            }
            let Some(reference) = schema.get(keyword).and_then(Value::as_str) else {
                continue;
            };
            let reference = if keyword == "$recursiveRef" {
                self.recursive_refs.push(id);
                "#"
            } else {
                reference
            };
            if keyword == "$dynamicRef" {
                if let Some((_, anchor)) = reference.rsplit_once('#') {
                    self.dynamic_refs.push((id, anchor.to_string()));
                }
            }
            let Ok(resolved) = resolver.lookup(reference) else {
                continue;
            };
            let (contents, resolver, draft) = resolved.into_inner();
            let target = self.node(contents, resolver, draft, reference);
            // jsonschema drops a `$ref`/`$dynamicRef` to the subschema that holds it, but
            // not a `$recursiveRef` (that one overflows the stack).
            if target != id || keyword == "$recursiveRef" {
                self.edges[id].push(target);
            }
        }
    }
}

/// `#/a/b~1c` for every value in the document, by address.
fn pointers(value: &Value, pointer: &mut String, out: &mut HashMap<*const Value, String>) {
    out.insert(
        value as *const Value,
        if pointer.is_empty() {
            "#".to_string()
        } else {
            format!("#{pointer}")
        },
    );
    let len = pointer.len();
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                pointer.push('/');
                pointer.push_str(&key.replace('~', "~0").replace('/', "~1"));
                pointers(child, pointer, out);
                pointer.truncate(len);
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                pointer.push('/');
                pointer.push_str(&i.to_string());
                pointers(child, pointer, out);
                pointer.truncate(len);
            }
        }
        _ => {}
    }
}

impl Graph {
    /// The graph, or `None` when the document cannot be put in a registry (an invalid
    /// `$id`, an unknown `$schema`): jsonschema refuses those too.
    fn of(schema: &Value) -> Option<Graph> {
        let draft = Draft::default().detect(schema);
        if draft == Draft::Unknown {
            return None;
        }
        let resource = draft.create_resource_ref(schema);
        let base = referencing::uri::from_str(resource.id().unwrap_or(DEFAULT_BASE)).ok()?;
        let registry = Registry::new()
            .draft(draft)
            .add(base.as_str(), resource)
            .ok()?
            .prepare()
            .ok()?;
        let resolver = registry.resolver(base);
        let root = resolver.lookup("").ok()?;
        let mut walk = Walk {
            ids: HashMap::new(),
            pointers: HashMap::new(),
            names: Vec::new(),
            edges: Vec::new(),
            steps: Vec::new(),
            queue: Vec::new(),
            dynamic_anchors: HashMap::new(),
            recursive_anchors: Vec::new(),
            dynamic_refs: Vec::new(),
            recursive_refs: Vec::new(),
        };
        pointers(root.contents(), &mut String::new(), &mut walk.pointers);
        let (contents, resolver, draft) = root.into_inner();
        walk.node(contents, resolver, draft, "#");
        while let Some((id, value, resolver, draft)) = walk.queue.pop() {
            walk.visit(id, value, resolver, draft);
        }
        // Dynamic references may land on any subschema with a matching dynamic anchor,
        // depending on the path taken: every such one counts.
        for (from, anchor) in std::mem::take(&mut walk.dynamic_refs) {
            for to in walk.dynamic_anchors.get(&anchor).into_iter().flatten() {
                if *to != from {
                    walk.edges[from].push(*to);
                }
            }
        }
        for from in std::mem::take(&mut walk.recursive_refs) {
            walk.edges[from].extend(walk.recursive_anchors.iter().copied());
        }
        for edges in &mut walk.edges {
            edges.sort_unstable();
            edges.dedup();
        }
        Some(Graph {
            names: walk.names,
            edges: walk.edges,
            steps: walk.steps,
        })
    }

    /// The first in-place cycle found, as names from its entry back to it.
    fn cycle(&self) -> Option<Vec<String>> {
        #[derive(Clone, Copy, PartialEq)]
        enum Mark {
            New,
            Open,
            Done,
        }
        let mut mark = vec![Mark::New; self.names.len()];
        for start in 0..self.names.len() {
            if mark[start] != Mark::New {
                continue;
            }
            // (node, next edge to follow)
            let mut stack = vec![(start, 0)];
            mark[start] = Mark::Open;
            while let Some(&mut (node, ref mut next)) = stack.last_mut() {
                if let Some(&to) = self.edges[node].get(*next) {
                    *next += 1;
                    match mark[to] {
                        Mark::New => {
                            mark[to] = Mark::Open;
                            stack.push((to, 0));
                        }
                        Mark::Open => {
                            let from = stack.iter().position(|(n, _)| *n == to).unwrap_or(0);
                            let mut names: Vec<String> = stack[from..]
                                .iter()
                                .map(|(n, _)| self.names[*n].clone())
                                .collect();
                            names.push(self.names[to].clone());
                            return Some(names);
                        }
                        Mark::Done => {}
                    }
                } else {
                    mark[node] = Mark::Done;
                    stack.pop();
                }
            }
        }
        None
    }

    /// The most subschemas any one subschema applies to a single instance value (itself
    /// included), counting every path. Only meaningful once [`Graph::cycle`] found none.
    fn max_fanout(&self) -> u64 {
        let n = self.names.len();
        let mut fanout: Vec<Option<u64>> = vec![None; n];
        for start in 0..n {
            let mut stack = vec![(start, false)];
            while let Some((node, expanded)) = stack.pop() {
                if fanout[node].is_some() {
                    continue;
                }
                if expanded {
                    let total = self.edges[node]
                        .iter()
                        .map(|c| fanout[*c].unwrap_or(0))
                        .fold(1u64, u64::saturating_add);
                    fanout[node] = Some(total);
                } else {
                    stack.push((node, true));
                    stack.extend(
                        self.edges[node]
                            .iter()
                            .filter(|c| fanout[**c].is_none())
                            .map(|c| (*c, false)),
                    );
                }
            }
        }
        fanout.into_iter().flatten().max().unwrap_or(1)
    }
}

/// Strongly connected components (Tarjan, iterative): the component of each node.
fn components(adj: &[Vec<usize>]) -> Vec<usize> {
    let n = adj.len();
    let (mut index, mut low, mut comp) = (vec![usize::MAX; n], vec![0; n], vec![usize::MAX; n]);
    let (mut on_stack, mut stack, mut next_index, mut next_comp) = (vec![false; n], vec![], 0, 0);
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0usize)];
        index[root] = next_index;
        low[root] = next_index;
        next_index += 1;
        stack.push(root);
        on_stack[root] = true;
        while let Some(&mut (v, ref mut i)) = work.last_mut() {
            if let Some(&w) = adj[v].get(*i) {
                *i += 1;
                if index[w] == usize::MAX {
                    index[w] = next_index;
                    low[w] = next_index;
                    next_index += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    comp[w] = next_comp;
                    if w == v {
                        break;
                    }
                }
                next_comp += 1;
            }
        }
    }
    comp
}

/// Product-graph edges examined at most: past that, recursion is refused unanalysed.
const MAX_PRODUCT_EDGES: usize = 1 << 20;

impl Graph {
    /// A recursion that reaches the same part of an instance along two different paths,
    /// level after level: `{"allOf":[{"items":{"$ref":"#"}},{"items":{"$ref":"#"}}]}`
    /// makes jsonschema compile and evaluate 2^depth subschemas for an answer nested
    /// `depth` arrays deep (22 levels exhausted 3 GB). This is the exponential ambiguity
    /// of an automaton whose states are subschemas and whose letters are instance steps:
    /// two distinct cycles through one subschema over overlapping steps. Only meaningful
    /// once [`Graph::cycle`] found no in-place cycle.
    /// `Ok(true)` when the schema recurses at all (each level of an answer's nesting may
    /// then compile another copy of it, kept by the cached validator).
    fn recursion(&self) -> Result<bool, String> {
        let n = self.names.len();
        // One descending edge per (subschema, step, target), counting the in-place
        // walks that lead to it.
        let mut hops: Vec<Vec<(PathStep, usize, u64)>> = vec![Vec::new(); n];
        for (from, hop) in hops.iter_mut().enumerate() {
            let mut counts: HashMap<(&PathStep, usize), u64> = HashMap::new();
            let mut stack = vec![from];
            while let Some(m) = stack.pop() {
                for (step, to) in &self.steps[m] {
                    *counts.entry((step, *to)).or_default() += 1;
                }
                stack.extend(&self.edges[m]);
            }
            *hop = counts
                .into_iter()
                .map(|((step, to), k)| (step.clone(), to, k))
                .collect();
            hop.sort_by_key(|(_, to, _)| *to);
        }
        let adj: Vec<Vec<usize>> = hops
            .iter()
            .map(|h| h.iter().map(|(_, to, _)| *to).collect())
            .collect();
        let comp = components(&adj);
        let recursive = hops
            .iter()
            .enumerate()
            .any(|(from, hop)| hop.iter().any(|(_, to, _)| comp[*to] == comp[from]));
        if !recursive {
            return Ok(false);
        }
        // Two walks to the same subschema for the same step, inside a recursion.
        for (from, hop) in hops.iter().enumerate() {
            if let Some((_, to, _)) = hop
                .iter()
                .find(|(_, to, k)| *k > 1 && comp[*to] == comp[from])
            {
                return Err(self.names[*to].clone());
            }
        }
        // Two distinct cycles over overlapping steps: in the product of the recursion
        // with itself, a cycle through a diagonal pair that takes two different edges.
        let mut members: HashMap<usize, Vec<usize>> = HashMap::new();
        for (node, c) in comp.iter().enumerate() {
            members.entry(*c).or_default().push(node);
        }
        for nodes in members.values() {
            let local: HashMap<usize, usize> =
                nodes.iter().enumerate().map(|(i, g)| (*g, i)).collect();
            // (step, local target, edge id) inside the component, per local node.
            let mut inner: Vec<Vec<(&PathStep, usize, usize)>> = vec![Vec::new(); nodes.len()];
            let mut edge_id = 0;
            for (i, g) in nodes.iter().enumerate() {
                for (step, to, _) in &hops[*g] {
                    if let Some(t) = local.get(to) {
                        inner[i].push((step, *t, edge_id));
                        edge_id += 1;
                    }
                }
            }
            if edge_id < 2 {
                continue;
            }
            if edge_id.saturating_mul(edge_id) > MAX_PRODUCT_EDGES {
                return Err(self.names[nodes[0]].clone());
            }
            let k = nodes.len();
            let pair = |p: usize, q: usize| p * k + q;
            let mut product = vec![Vec::new(); k * k];
            let mut diverging = Vec::new();
            for p in 0..k {
                for q in 0..k {
                    for (s1, t1, e1) in &inner[p] {
                        for (s2, t2, e2) in &inner[q] {
                            if s1.overlaps(s2) {
                                product[pair(p, q)].push(pair(*t1, *t2));
                                if e1 != e2 {
                                    diverging.push((pair(p, q), pair(*t1, *t2)));
                                }
                            }
                        }
                    }
                }
            }
            let pcomp = components(&product);
            let diagonal: HashSet<usize> = (0..k).map(|q| pcomp[pair(q, q)]).collect();
            if let Some((x, _)) = diverging
                .iter()
                .find(|(x, y)| pcomp[*x] == pcomp[*y] && diagonal.contains(&pcomp[*x]))
            {
                return Err(self.names[nodes[x / k]].clone());
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LIMITS: ShapeLimits = ShapeLimits {
        max_depth: 32,
        max_paths: 64,
        max_fanout: 1024,
    };

    fn cycle(schema: Value) -> String {
        find_cycle(&schema).unwrap_or_else(|| panic!("no cycle found in {schema}"))
    }

    fn no_cycle(schema: Value) {
        assert_eq!(find_cycle(&schema), None, "{schema}");
        check(&schema, &LIMITS).unwrap();
    }

    #[test]
    fn all_of_back_to_the_root_is_a_cycle() {
        assert_eq!(
            cycle(json!({"allOf": [{"$ref": "#"}]})),
            "# -> #/allOf/0 -> #"
        );
        let err = check(&json!({"allOf": [{"$ref": "#"}]}), &LIMITS).unwrap_err();
        assert_eq!(
            err,
            "the schema has a reference cycle that consumes no input: # -> #/allOf/0 -> #"
        );
    }

    #[test]
    fn cycles_through_defs_and_every_in_place_keyword_are_found() {
        let through_defs = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"});
        assert!(cycle(through_defs).contains("#/$defs/a -> #/$defs/b"));
        let pure_refs = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"});
        cycle(pure_refs);
        for schema in [
            json!({"anyOf": [{"type": "null"}, {"$ref": "#"}]}),
            json!({"oneOf": [{"$ref": "#"}]}),
            json!({"not": {"$ref": "#"}}),
            json!({"if": {"$ref": "#"}, "then": {}}),
            json!({"if": {}, "then": {"$ref": "#"}}),
            json!({"if": {}, "else": {"$ref": "#"}}),
            json!({"dependentSchemas": {"a": {"$ref": "#"}}}),
            json!({"$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": {"$ref": "#"}}}),
            json!({"properties": {"a": {"allOf": [{"$ref": "#/properties/a"}]}}}),
            // A pointer into a non-schema keyword is still followed, as jsonschema does.
            json!({"$ref": "#/const", "const": {"allOf": [{"$ref": "#"}]}}),
        ] {
            cycle(schema);
        }
    }

    #[test]
    fn pointers_are_decoded_like_jsonschema_does() {
        let escaped = json!({"$defs": {"a/b": {"allOf": [{"$ref": "#/$defs/a~1b"}]}}, "$ref": "#/$defs/a~1b"});
        assert!(cycle(escaped).contains("#/$defs/a~1b/allOf/0"));
        let percent = json!({"$defs": {"a b": {"allOf": [{"$ref": "#/$defs/a%20b"}]}}, "$ref": "#/$defs/a%20b"});
        cycle(percent);
    }

    #[test]
    fn anchors_ids_and_dynamic_references_are_resolved() {
        cycle(
            json!({"$defs": {"x": {"$anchor": "foo", "allOf": [{"$ref": "#foo"}]}}, "$ref": "#foo"}),
        );
        cycle(json!({"$dynamicAnchor": "n", "allOf": [{"$dynamicRef": "#n"}]}));
        cycle(
            json!({"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveAnchor": true, "allOf": [{"$recursiveRef": "#"}]}),
        );
        cycle(
            json!({"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveAnchor": true, "$recursiveRef": "#"}),
        );
        cycle(
            json!({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"x": {"$id": "#foo", "allOf": [{"$ref": "#foo"}]}}, "allOf": [{"$ref": "#foo"}]}),
        );
        cycle(
            json!({"$id": "https://example.com/root", "$defs": {"s": {"$id": "sub", "anyOf": [{"$ref": "sub"}]}}, "$ref": "https://example.com/sub"}),
        );
    }

    #[test]
    fn recursion_that_consumes_input_and_self_references_pass() {
        no_cycle(
            json!({"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}),
        );
        no_cycle(
            json!({"$defs": {"node": {"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}}}}, "$ref": "#/$defs/node"}),
        );
        no_cycle(json!({"$ref": "#"}));
        no_cycle(json!({"$ref": "#", "type": "object", "properties": {"a": {"$ref": "#"}}}));
        no_cycle(json!({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}));
        no_cycle(json!({"$dynamicAnchor": "n", "$dynamicRef": "#n"}));
        no_cycle(json!({"propertyNames": {"$ref": "#"}}));
        no_cycle(
            json!({"allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "string"}}}),
        );
        // Draft 7: `$ref` hides its siblings, so this `allOf` never applies.
        no_cycle(
            json!({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"s": {"type": "string"}}, "$ref": "#/definitions/s", "allOf": [{"$ref": "#"}]}),
        );
        // Unresolvable and remote references add no edge; compilation decides.
        assert_eq!(find_cycle(&json!({"allOf": [{"$ref": "#/nowhere"}]})), None);
    }

    #[test]
    fn recursion_reaching_one_value_along_two_paths_is_refused() {
        let doubling = |schema: Value| {
            let err = check(&schema, &LIMITS).unwrap_err();
            assert!(
                err.contains("doubles with each level of nesting"),
                "{schema}: {err}"
            );
        };
        doubling(json!({"allOf": [{"items": {"$ref": "#"}}, {"items": {"$ref": "#"}}]}));
        doubling(json!({"items": {"$ref": "#"}, "contains": {"$ref": "#"}}));
        doubling(
            json!({"properties": {"a": {"$ref": "#"}}, "patternProperties": {"^a": {"$ref": "#"}}}),
        );
        // Through two subschemas, over alternating steps.
        doubling(
            json!({"$defs": {"x": {"properties": {"p": {"$ref": "#"}}}}, "anyOf": [{"items": {"$ref": "#/$defs/x"}}, {"items": {"$ref": "#/$defs/x"}}]}),
        );

        // One path per part of the value: fine, however much it branches.
        let json_value = json!({"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "object", "additionalProperties": {"$ref": "#"}}, {"type": ["string", "number", "boolean", "null"]}]});
        check(&json_value, &LIMITS).unwrap();
        check(
            &json!({"properties": {"left": {"$ref": "#"}, "right": {"$ref": "#"}}}),
            &LIMITS,
        )
        .unwrap();
        check(
            &json!({"properties": {"a": {"$ref": "#"}}, "additionalProperties": {"$ref": "#"}}),
            &LIMITS,
        )
        .unwrap();
        check(
            &json!({"prefixItems": [{"$ref": "#"}, {"$ref": "#"}]}),
            &LIMITS,
        )
        .unwrap();
    }

    #[test]
    fn depth_paths_and_fanout_have_limits() {
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"not": deep});
        }
        assert_eq!(depth(&deep), 41);
        assert!(check(&deep, &LIMITS)
            .unwrap_err()
            .contains("nests 41 levels deep; the limit (validation.max_schema_depth) is 32"));

        fn tree(d: u32) -> Value {
            if d == 0 {
                return json!({});
            }
            json!({"not": tree(d - 1), "allOf": [tree(d - 1)], "anyOf": [tree(d - 1)], "oneOf": [tree(d - 1)], "items": tree(d - 1), "contains": tree(d - 1)})
        }
        assert_eq!(keyword_paths(&tree(2), 1000), 6 + 36);
        assert!(check(&tree(3), &LIMITS)
            .unwrap_err()
            .contains("more than 64 distinct keyword paths (validation.max_schema_paths)"));
        // A thousand properties are one keyword path.
        let wide: serde_json::Map<String, Value> = (0..1000)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        assert_eq!(keyword_paths(&json!({"properties": wide}), 64), 1);

        let mut defs = serde_json::Map::new();
        for k in 0..22 {
            let next = format!("#/$defs/d{}", k + 1);
            defs.insert(
                format!("d{k}"),
                json!({"allOf": [{"$ref": next}, {"$ref": next}]}),
            );
        }
        defs.insert("d22".into(), json!({"type": "object"}));
        let bomb = json!({"$defs": defs, "$ref": "#/$defs/d0"});
        let err = check(&bomb, &LIMITS).unwrap_err();
        assert!(
            err.contains("applies 16777214 subschemas to one value; the limit (validation.max_schema_fanout) is 1024"),
            "{err}"
        );
    }
}
