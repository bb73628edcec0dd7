//! JavaScript bindings workers-rs 0.8 does not expose.

use wasm_bindgen::prelude::*;

#[wasm_bindgen]
extern "C" {
    /// A queue message as the platform hands it over, with `attempts`.
    #[wasm_bindgen(extends = js_sys::Object)]
    #[derive(Debug, Clone)]
    pub(crate) type JsMessage;

    /// The delivery attempt, starting at 1.
    #[wasm_bindgen(method, getter)]
    pub(crate) fn attempts(this: &JsMessage) -> f64;

    /// The platform's message id.
    #[wasm_bindgen(method, getter)]
    pub(crate) fn id(this: &JsMessage) -> String;

    /// The body as sent.
    #[wasm_bindgen(method, getter)]
    pub(crate) fn body(this: &JsMessage) -> JsValue;

    /// Marks the message acknowledged.
    #[wasm_bindgen(method, catch)]
    pub(crate) fn ack(this: &JsMessage) -> Result<(), JsValue>;

    /// Marks the message for redelivery (`{ delaySeconds }` or undefined).
    #[wasm_bindgen(method, catch)]
    pub(crate) fn retry(this: &JsMessage, options: &JsValue) -> Result<(), JsValue>;
}

/// The body as bytes: a string's UTF-8, a byte array's bytes, anything
/// else as its JSON text (messages sent by other producers).
pub(crate) fn body_bytes(body: &JsValue) -> Vec<u8> {
    if let Some(text) = body.as_string() {
        return text.into_bytes();
    }
    if body.is_instance_of::<js_sys::Uint8Array>() || body.is_instance_of::<js_sys::ArrayBuffer>() {
        return js_sys::Uint8Array::new(body).to_vec();
    }
    js_sys::JSON::stringify(body)
        .ok()
        .and_then(|s| s.as_string())
        .unwrap_or_default()
        .into_bytes()
}

/// `{ delaySeconds: n }`, or undefined for the consumer's default delay.
pub(crate) fn retry_options(delay_seconds: Option<u32>) -> JsValue {
    match delay_seconds {
        None => JsValue::UNDEFINED,
        Some(seconds) => {
            let options = js_sys::Object::new();
            let _ = js_sys::Reflect::set(&options, &"delaySeconds".into(), &JsValue::from(seconds));
            options.into()
        }
    }
}

/// Text of a JavaScript error.
pub(crate) fn describe(error: &JsValue) -> String {
    error
        .as_string()
        .or_else(|| {
            js_sys::JSON::stringify(error)
                .ok()
                .and_then(|s| s.as_string())
        })
        .unwrap_or_else(|| format!("{error:?}"))
}
