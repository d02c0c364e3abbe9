"""The one chat path (`run.start_chat`) every API's chat takes, and what it plans: tools
(`tools`, `tool_formats`), the thinking section (`reasoning`), structured output
(`structured`), the sampler fields and defaults (`samplers`, `defaults`), and the reply read
for its structure (`reply`)."""
