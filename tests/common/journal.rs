//! The journal contract every store passes (`store::Journals`): entries read back
//! oldest first, one per call id (a later write replaces it), per tenant and session,
//! the newest `max_entries` kept.

use backstop::store::{JournalRecord, Journals};

fn record(call_id: &str, at_ms: i64, entry: &str) -> JournalRecord {
    JournalRecord {
        call_id: call_id.into(),
        at_ms,
        proposed: false,
        entry: entry.into(),
    }
}

fn proposal(call_id: &str, at_ms: i64) -> JournalRecord {
    JournalRecord {
        proposed: true,
        ..record(call_id, at_ms, "{}")
    }
}

/// Runs the contract on `store`, under tenant `tenant` (unique to the run).
pub async fn journal_contract(store: &dyn Journals, tenant: &str) {
    let ids = |records: Vec<JournalRecord>| -> Vec<(String, String)> {
        records.into_iter().map(|r| (r.call_id, r.entry)).collect()
    };
    assert!(store.journal(tenant, "s").await.unwrap().is_empty());
    store
        .write_journal(
            tenant,
            "s",
            vec![record("b", 20, "{\"n\":2}"), record("a", 10, "{\"n\":1}")],
            3,
            60_000,
        )
        .await
        .unwrap();
    assert_eq!(
        ids(store.journal(tenant, "s").await.unwrap()),
        [
            ("a".into(), "{\"n\":1}".into()),
            ("b".into(), "{\"n\":2}".into())
        ],
        "oldest first"
    );
    // A later write of a call id replaces its entry (a proposal answered, a repeat
    // counted); past `max_entries` the oldest go.
    store
        .write_journal(
            tenant,
            "s",
            vec![
                record("a", 30, "{\"n\":1,\"ok\":true}"),
                record("c", 40, "{}"),
                record("d", 50, "{}"),
            ],
            3,
            60_000,
        )
        .await
        .unwrap();
    let kept = store.journal(tenant, "s").await.unwrap();
    assert_eq!(
        kept.iter()
            .map(|r| (r.call_id.as_str(), r.at_ms))
            .collect::<Vec<_>>(),
        [("a", 30), ("c", 40), ("d", 50)]
    );
    assert_eq!(kept[0].entry, "{\"n\":1,\"ok\":true}");
    assert!(kept.iter().all(|r| !r.proposed));
    // A proposal newer than every entry goes before them when the journal is full: the
    // committed calls are what it is kept for.
    store
        .write_journal(tenant, "s", vec![proposal("p", 60)], 3, 60_000)
        .await
        .unwrap();
    let kept = store.journal(tenant, "s").await.unwrap();
    assert_eq!(
        kept.iter().map(|r| r.call_id.as_str()).collect::<Vec<_>>(),
        ["a", "c", "d"],
        "the proposal was dropped, not the oldest committed entry"
    );
    store
        .write_journal(tenant, "s", vec![proposal("p", 70)], 4, 60_000)
        .await
        .unwrap();
    let kept = store.journal(tenant, "s").await.unwrap();
    assert_eq!(
        kept.last().map(|r| (r.call_id.as_str(), r.proposed)),
        Some(("p", true))
    );
    assert!(store.journal(tenant, "other").await.unwrap().is_empty());
    assert!(store
        .journal(&format!("{tenant}-other"), "s")
        .await
        .unwrap()
        .is_empty());
}
