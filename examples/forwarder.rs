//! The floor every benchmark is read against: a bare forwarder, the least a proxy in
//! this stack can do. A hyper server and one shared `reqwest::Client`; each request's
//! body is collected and re-sent to the upstream with the same path, and the upstream's
//! status, content type and body come back. No auth, routing, limits, logs or metrics.
//!
//!     cargo run --release --example forwarder -- LISTEN_PORT UPSTREAM_URL
//!
//! `examples/bench` starts it beside Backstop so both are measured in the same run.

use std::{convert::Infallible, net::SocketAddr};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http1, service::service_fn, Request, Response};
use hyper_util::rt::TokioIo;

async fn forward(
    client: reqwest::Client,
    upstream: String,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path().to_string();
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return Ok(status(400)),
    };
    let sent = client
        .post(format!("{upstream}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    let Ok(answer) = sent else {
        return Ok(status(502));
    };
    let code = answer.status();
    let content_type = answer.headers().get("content-type").cloned();
    let Ok(bytes) = answer.bytes().await else {
        return Ok(status(502));
    };
    let mut out = Response::new(Full::new(bytes));
    *out.status_mut() = code;
    if let Some(ct) = content_type {
        out.headers_mut().insert("content-type", ct);
    }
    Ok(out)
}

fn status(code: u16) -> Response<Full<Bytes>> {
    let mut out = Response::new(Full::new(Bytes::new()));
    *out.status_mut() = hyper::StatusCode::from_u16(code).unwrap_or_default();
    out
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().and_then(|p| p.parse().ok()).unwrap_or(8090);
    let upstream = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:8081".into());
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .build()
        .expect("TLS backend initialises");
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let (client, upstream) = (client.clone(), upstream.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| forward(client.clone(), upstream.clone(), req));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
