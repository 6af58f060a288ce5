//! `backstop report`: spend per tenant, UTC day and model, summed from the ledger of the
//! store the config names ([`Ledger::spend_report`]), printed as CSV or JSON. It opens
//! the store to read only ([`store::open_ledger_reader`]), so it runs beside gateways
//! serving from the same store and never starts one.

use std::sync::Arc;

use crate::{
    clock::Date,
    config::Config,
    policy::budget::Usd,
    store::{self, Ledger, OpenError, ReportQuery, ReportRow},
};

/// The columns, in order: the CSV header and the JSON keys.
/// Token columns are the ledger's: `input_tokens` is input billed at the input price
/// (OpenAI's prompt less its cached part), `cache_write_tokens` every cache write and
/// `cache_write_1h_tokens` the part of them kept an hour, `cache_read_tokens` cache
/// reads (OpenAI's cached input), `reasoning_tokens` the part of `output_tokens` that
/// was reasoning, `web_searches` server-side searches.
pub const COLUMNS: [&str; 12] = [
    "tenant",
    "day",
    "model",
    "calls",
    "input_tokens",
    "output_tokens",
    "cache_write_tokens",
    "cache_write_1h_tokens",
    "cache_read_tokens",
    "reasoning_tokens",
    "web_searches",
    "usd",
];

/// How the report is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    #[default]
    Csv,
    Json,
}

impl std::str::FromStr for Format {
    type Err = String;

    fn from_str(text: &str) -> Result<Format, String> {
        match text {
            "csv" => Ok(Format::Csv),
            "json" => Ok(Format::Json),
            _ => Err(format!("`{text}` is not a format: csv or json")),
        }
    }
}

/// What the command line asks for.
#[derive(Debug, Clone, Default)]
pub struct Args {
    pub tenant: Option<String>,
    pub from: Option<Date>,
    pub to: Option<Date>,
    pub format: Format,
}

/// Why no report was printed, and the exit code that says so.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The arguments or the config are wrong: fix the command (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// The store could not be opened or read (exit code 1).
    #[error("{0}")]
    Store(String),
}

impl ReportError {
    pub fn exit_code(&self) -> u8 {
        match self {
            ReportError::Usage(_) => 2,
            ReportError::Store(_) => 1,
        }
    }
}

impl Args {
    /// The ledger query these arguments ask for.
    pub fn query(&self) -> Result<ReportQuery, ReportError> {
        if let (Some(from), Some(to)) = (self.from, self.to) {
            if from > to {
                return Err(ReportError::Usage(format!(
                    "--from {from} is after --to {to}: the range would be empty"
                )));
            }
        }
        Ok(ReportQuery {
            tenant: self.tenant.clone(),
            from_day: self.from.map(|d| d.0),
            to_day: self.to.map(|d| d.0),
        })
    }
}

/// Opens the ledger `config` names to read it, and prints what `args` ask for.
pub async fn run(config: &Config, args: &Args) -> Result<String, ReportError> {
    let query = args.query()?;
    if config.store.backend == crate::config::StoreBackend::Postgres {
        let rows = store::read_postgres_report(&config.store, &query)
            .await
            .map_err(|e| ReportError::Store(e.to_string()))?;
        return Ok(render(&rows, args.format));
    }
    let ledger: Arc<dyn Ledger> =
        store::open_ledger_reader(&config.store).map_err(|e| match e {
            OpenError::Config(why) => ReportError::Usage(why),
            OpenError::Store(why) => ReportError::Store(why),
        })?;
    let rows = ledger
        .spend_report(&query)
        .await
        .map_err(|e| ReportError::Store(format!("{}: {e}", config.store.path)))?;
    Ok(render(&rows, args.format))
}

/// The rows as `format`: days as `YYYY-MM-DD`, dollars rounded to the micro-dollar.
pub fn render(rows: &[ReportRow], format: Format) -> String {
    match format {
        Format::Csv => csv(rows),
        Format::Json => {
            let rows: Vec<_> = rows.iter().map(JsonRow::from).collect();
            let mut text = serde_json::to_string_pretty(&rows).unwrap_or_default();
            text.push('\n');
            text
        }
    }
}

/// A row of the JSON report: its keys in [`COLUMNS`] order.
#[derive(serde::Serialize)]
struct JsonRow<'a> {
    tenant: &'a str,
    day: String,
    model: &'a str,
    calls: u64,
    input_tokens: u64,
    output_tokens: u64,
    cache_write_tokens: u64,
    cache_write_1h_tokens: u64,
    cache_read_tokens: u64,
    reasoning_tokens: u64,
    web_searches: u64,
    usd: Usd,
}

impl<'a> From<&'a ReportRow> for JsonRow<'a> {
    fn from(r: &'a ReportRow) -> Self {
        JsonRow {
            tenant: &r.tenant,
            day: Date(r.day).to_string(),
            model: &r.model,
            calls: r.calls,
            input_tokens: r.tokens.input,
            output_tokens: r.tokens.output,
            cache_write_tokens: r.tokens.cache_write(),
            cache_write_1h_tokens: r.tokens.cache_write_1h,
            cache_read_tokens: r.tokens.cache_read,
            reasoning_tokens: r.tokens.reasoning,
            web_searches: r.tokens.web_searches,
            usd: Usd(r.usd),
        }
    }
}

/// RFC 4180: a header line, then a line per row; a field with a comma, a quote or a line
/// break is quoted, its quotes doubled. Lines end with `\n`. Tenant and model names are
/// made safe to open in a spreadsheet first ([`field`]).
fn csv(rows: &[ReportRow]) -> String {
    let mut out = COLUMNS.join(",");
    out.push('\n');
    for r in rows {
        let line = [
            field(&r.tenant),
            Date(r.day).to_string(),
            field(&r.model),
            r.calls.to_string(),
            r.tokens.input.to_string(),
            r.tokens.output.to_string(),
            r.tokens.cache_write().to_string(),
            r.tokens.cache_write_1h.to_string(),
            r.tokens.cache_read.to_string(),
            r.tokens.reasoning.to_string(),
            r.tokens.web_searches.to_string(),
            format!("{:.6}", Usd(r.usd).rounded()),
        ];
        out.push_str(&line.join(","));
        out.push('\n');
    }
    out
}

/// What a spreadsheet takes for the start of a formula when a cell begins with it.
const FORMULA_START: [char; 6] = ['=', '+', '-', '@', '\t', '\r'];

/// A text field of the CSV. Model names come from callers' requests and tenant names
/// from the config, and the report is made to be opened by finance people in Excel,
/// LibreOffice or Google Sheets, which run a cell starting with `=`, `+`, `-` or `@`
/// (or a tab or carriage return before one) as a formula: CSV injection. Such a name
/// gets a leading `'`, as OWASP advises, which they show as text; the JSON report, read
/// by programs, carries names as they are.
fn field(text: &str) -> String {
    let text = match text.starts_with(FORMULA_START) {
        true => std::borrow::Cow::Owned(format!("'{text}")),
        false => std::borrow::Cow::Borrowed(text),
    };
    if text.contains([',', '"', '\r', '\n']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, day: i64, model: &str, usd: f64) -> ReportRow {
        ReportRow {
            tenant: tenant.into(),
            day,
            model: model.into(),
            calls: 3,
            tokens: crate::billing::Tokens {
                input: 1000,
                cache_write_5m: 300,
                cache_write_1h: 100,
                cache_read: 5000,
                output: 20,
                reasoning: 8,
                web_searches: 1,
            },
            usd,
        }
    }

    #[test]
    fn csv_quotes_only_what_needs_it_and_writes_micro_dollars() {
        let rows = [
            row("team-a", 20_424, "gpt-4o", 0.1 + 0.2),
            row("a,b", 20_425, "say \"hi\"", 1e-6),
            row("t", 0, "line\nbreak", 12.0),
        ];
        assert_eq!(
            render(&rows, Format::Csv),
            "tenant,day,model,calls,input_tokens,output_tokens,cache_write_tokens,cache_write_1h_tokens,cache_read_tokens,reasoning_tokens,web_searches,usd\n\
             team-a,2025-12-02,gpt-4o,3,1000,20,400,100,5000,8,1,0.300000\n\
             \"a,b\",2025-12-03,\"say \"\"hi\"\"\",3,1000,20,400,100,5000,8,1,0.000001\n\
             t,1970-01-01,\"line\nbreak\",3,1000,20,400,100,5000,8,1,12.000000\n"
        );
        assert_eq!(
            render(&[], Format::Csv),
            "tenant,day,model,calls,input_tokens,output_tokens,cache_write_tokens,cache_write_1h_tokens,cache_read_tokens,reasoning_tokens,web_searches,usd\n"
        );
    }

    #[test]
    fn a_name_a_spreadsheet_would_run_as_a_formula_is_written_as_text() {
        let rows = [
            row("=cmd", 0, "+1", 1.0),
            row("@SUM(A1:A9)", 0, "-2", 1.0),
            row("\tx", 0, "=HYPERLINK(\"http://x\",\"y\")", 1.0),
            row("team-a", 0, "a=b", 1.0),
        ];
        let csv = render(&rows, Format::Csv);
        assert_eq!(
            csv.lines().skip(1).collect::<Vec<_>>(),
            [
                "'=cmd,1970-01-01,'+1,3,1000,20,400,100,5000,8,1,1.000000",
                "'@SUM(A1:A9),1970-01-01,'-2,3,1000,20,400,100,5000,8,1,1.000000",
                "'\tx,1970-01-01,\"'=HYPERLINK(\"\"http://x\"\",\"\"y\"\")\",3,1000,20,400,100,5000,8,1,1.000000",
                "team-a,1970-01-01,a=b,3,1000,20,400,100,5000,8,1,1.000000",
            ]
        );
        let json = render(&rows[..1], Format::Json);
        assert!(json.contains("\"tenant\": \"=cmd\""), "{json}");
    }

    #[test]
    fn json_is_an_array_of_rows_keyed_by_column_in_column_order() {
        let text = render(&[row("team-a", 20_424, "gpt-4o", 0.1 + 0.2)], Format::Json);
        assert_eq!(
            text,
            r#"[
  {
    "tenant": "team-a",
    "day": "2025-12-02",
    "model": "gpt-4o",
    "calls": 3,
    "input_tokens": 1000,
    "output_tokens": 20,
    "cache_write_tokens": 400,
    "cache_write_1h_tokens": 100,
    "cache_read_tokens": 5000,
    "reasoning_tokens": 8,
    "web_searches": 1,
    "usd": 0.3
  }
]
"#
        );
        assert_eq!(render(&[], Format::Json), "[]\n");
    }

    #[test]
    fn a_range_that_ends_before_it_starts_is_refused() {
        let args = Args {
            from: Some("2025-12-03".parse().unwrap()),
            to: Some("2025-12-02".parse().unwrap()),
            ..Args::default()
        };
        let err = args.query().unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert_eq!(
            err.to_string(),
            "--from 2025-12-03 is after --to 2025-12-02: the range would be empty"
        );
        let one_day = Args {
            tenant: Some("t".into()),
            from: Some(Date(5)),
            to: Some(Date(5)),
            ..Args::default()
        };
        assert_eq!(
            one_day.query().unwrap(),
            ReportQuery {
                tenant: Some("t".into()),
                from_day: Some(5),
                to_day: Some(5)
            }
        );
    }
}
