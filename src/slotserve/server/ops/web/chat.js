// The chat panel: conversations in tabs, each streaming from /v1/chat/completions with its
// own class, temperature and token limit. Several can run at once, so batching and class
// isolation show on the dashboard. Stop aborts the stream; the server cancels the request
// when its client goes away and frees the slot at the next batch boundary.

import { renderMarkdown } from "./markdown.js";
import { readEvents } from "./sse.js";

/** One conversation: its messages, its tab and panel, and its running request, if any. */
class Conversation {
  constructor(chat, number) {
    this.chat = chat;
    this.messages = []; // {role, content} sent to the server
    this.controller = null; // AbortController of the running request
    this.tab = document.createElement("button");
    this.tab.type = "button";
    this.tab.className = "tab";
    this.tab.setAttribute("role", "tab");
    this.tab.textContent = `Chat ${number}`;
    this.tab.addEventListener("click", () => chat.select(this));
    const template = document.getElementById("conversation-template");
    this.panel = template.content.firstElementChild.cloneNode(true);
    this.panel.dataset.conversation = String(number);
    this.list = this.panel.querySelector(".messages");
    this.prompt = this.panel.querySelector(".prompt");
    this.sendButton = this.panel.querySelector(".send");
    this.stopButton = this.panel.querySelector(".stop");
    this.panel.querySelector(".composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        this.send();
      }
    });
    this.stopButton.addEventListener("click", () => this.stop());
  }

  setting(selector) {
    return this.panel.querySelector(selector).value;
  }

  setBusy(busy) {
    this.sendButton.hidden = busy;
    this.stopButton.hidden = !busy;
    this.tab.classList.toggle("busy", busy);
  }

  addMessage(role, text) {
    const item = document.createElement("div");
    item.className = `msg ${role}`;
    item.innerHTML = `<div class="body"></div><div class="footer"></div>`;
    item.querySelector(".body").innerHTML = renderMarkdown(text);
    this.list.appendChild(item);
    this.list.scrollTop = this.list.scrollHeight;
    return item;
  }

  async send() {
    const text = this.prompt.value.trim();
    if (!text || this.controller) return;
    this.prompt.value = "";
    this.messages.push({ role: "user", content: text });
    this.addMessage("user", text);
    const reply = new Reply(this.addMessage("assistant", ""), this.setting(".priority"));
    this.controller = new AbortController();
    this.setBusy(true);
    try {
      await this.stream(reply);
    } catch (error) {
      if (error.name !== "AbortError") reply.fail(String(error.message || error));
    } finally {
      reply.finish(this.controller.signal.aborted);
      if (reply.text) this.messages.push({ role: "assistant", content: reply.text });
      this.controller = null;
      this.setBusy(false);
    }
  }

  async stream(reply) {
    const body = {
      model: this.chat.model,
      messages: this.messages,
      stream: true,
      stream_options: { include_usage: true },
      priority: this.setting(".priority"),
      temperature: Number(this.setting(".temperature")),
      max_tokens: Number(this.setting(".max-tokens")),
    };
    const response = await this.chat.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: this.controller.signal,
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      reply.fail(error.error?.message || `HTTP ${response.status}`);
      return;
    }
    for await (const data of readEvents(response)) {
      if (data === "[DONE]") break;
      reply.take(JSON.parse(data));
      this.list.scrollTop = this.list.scrollHeight;
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
  }
}

/** One streamed answer: its text as it arrives and the figures for its footer. */
class Reply {
  constructor(element, priority) {
    this.element = element;
    this.body = element.querySelector(".body");
    this.priority = priority;
    this.text = "";
    this.sent = performance.now();
    this.first = null; // time of the first text
    this.last = null;
    this.chunks = 0; // text chunks: about one a token when usage is not reported
    this.usage = null;
    this.reason = null;
    this.error = null;
    this.pending = false;
    element.classList.add("streaming");
  }

  take(chunk) {
    if (chunk.error) return this.fail(chunk.error.message);
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) return;
    if (choice.finish_reason) this.reason = choice.finish_reason;
    const piece = choice.delta?.content;
    if (!piece) return;
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    this.chunks += 1;
    this.text += piece;
    this.render();
  }

  /** Re-render at most once a frame, however fast tokens come. */
  render() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.body.innerHTML = renderMarkdown(this.text);
    });
  }

  fail(message) {
    this.error = message;
  }

  finish(stopped) {
    this.element.classList.remove("streaming");
    this.body.innerHTML = renderMarkdown(this.text);
    if (this.error) {
      const note = document.createElement("div");
      note.className = "error";
      note.textContent = this.error;
      this.body.appendChild(note);
    }
    this.element.querySelector(".footer").textContent = this.footer(stopped);
  }

  footer(stopped) {
    const parts = [this.priority];
    if (this.first !== null) parts.push(`TTFT ${Math.round(this.first - this.sent)} ms`);
    const tokens = this.usage ? this.usage.completion_tokens : this.chunks;
    const span = (this.last - this.first) / 1000;
    if (tokens > 1 && span > 0) parts.push(`${((tokens - 1) / span).toFixed(1)} tok/s`);
    parts.push(`${this.usage ? "" : "≈"}${tokens} tokens`);
    parts.push(stopped ? "stopped" : this.reason || (this.error ? "error" : "ended"));
    return parts.join(" · ");
  }
}

/** The panel: tabs of conversations, any number running at once. */
export class Chat {
  constructor(root, model, fetchWithKey) {
    this.root = root;
    this.model = model;
    this.fetch = fetchWithKey;
    this.conversations = [];
    this.count = 0;
    root.querySelector("#new-tab").addEventListener("click", () => this.open());
  }

  /** A new conversation, selected. */
  open() {
    this.count += 1;
    const conversation = new Conversation(this, this.count);
    this.conversations.push(conversation);
    this.root.querySelector("#tabs").insertBefore(conversation.tab, this.root.querySelector("#new-tab"));
    this.root.querySelector("#conversations").appendChild(conversation.panel);
    this.select(conversation);
    return conversation;
  }

  select(chosen) {
    for (const conversation of this.conversations) {
      const selected = conversation === chosen;
      conversation.tab.classList.toggle("selected", selected);
      conversation.tab.setAttribute("aria-selected", String(selected));
      conversation.panel.hidden = !selected;
    }
    chosen.prompt.focus();
  }
}
