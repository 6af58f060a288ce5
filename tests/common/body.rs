//! Request bodies for the tests: one chat completion shape, varied by what a test needs.
#![allow(dead_code)]

use std::ops::Deref;

use serde_json::{json, Value};

/// A chat completion request for `model`, one user message saying "hello".
pub fn chat(model: &str) -> Chat {
    Chat(json!({"model": model, "messages": [{"role": "user", "content": "hello"}]}))
}

/// A chat completion body under construction; it becomes JSON with [`Chat::json`] or `into()`.
#[derive(Clone, Debug)]
pub struct Chat(Value);

impl Chat {
    /// The user message says `content` instead.
    pub fn saying(mut self, content: impl Into<String>) -> Chat {
        self.0["messages"][0]["content"] = Value::String(content.into());
        self
    }

    pub fn max_tokens(mut self, max_tokens: u64) -> Chat {
        self.0["max_tokens"] = max_tokens.into();
        self
    }

    pub fn stream(mut self) -> Chat {
        self.0["stream"] = true.into();
        self
    }

    pub fn json(self) -> Value {
        self.0
    }
}

/// Where a `&Value` is wanted, `&chat(..)` will do.
impl Deref for Chat {
    type Target = Value;

    fn deref(&self) -> &Value {
        &self.0
    }
}

impl From<Chat> for Value {
    fn from(chat: Chat) -> Value {
        chat.0
    }
}

impl From<Chat> for reqwest::Body {
    fn from(chat: Chat) -> reqwest::Body {
        chat.0.to_string().into()
    }
}
