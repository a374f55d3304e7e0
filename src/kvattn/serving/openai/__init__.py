"""`kvattn serve`'s OpenAI HTTP API on the engine: request bodies (`protocol`), the app, its responses, metrics.

A request body becomes the engine's `kvattn.generation.SamplingParams` in one
function, `protocol.job`; the app submits it to the `kvattn.serving.engine.Engine`
and turns the tokens it sends back into text with `kvattn.serving.text.TextStream`.
"""
