# Multi-stage build: compile in the Rust image, run in a slim Debian as a non-root user.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# make: jemalloc (the binary's allocator) is built from source.
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY src ./src
RUN cargo build --release --locked --bin backstop

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/backstop --create-home backstop
COPY --from=build /src/target/release/backstop /usr/local/bin/backstop
COPY config /etc/backstop
# Inside a container the listener must not be loopback-only.
RUN sed -i 's/^listen = "127.0.0.1:8080"/listen = "0.0.0.0:8080"/' /etc/backstop/backstop.toml
USER backstop
WORKDIR /var/lib/backstop
EXPOSE 8080
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/backstop"]
CMD ["serve", "--config", "/etc/backstop/backstop.toml"]
