"""OpenAI's Responses API over the chat path: the request (`request`), its custom tools
(`custom`), the reply's output items and events (`events`), the stored responses (`store`),
and the route's answer (`api`)."""
