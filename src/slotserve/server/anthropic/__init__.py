"""Anthropic's Messages API over the chat path: the request (`messages`) and the reply, whole
or streamed (`reply`)."""
