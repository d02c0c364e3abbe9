// The page's entry point: the API key (asked for once, when the server wants one), the
// authorised fetch both panels use, and start-up of the chat and the dashboard.

import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";

const KEY_STORAGE = "slotserve.apiKey";
let keyPrompt = null; // one pending dialog, however many requests were refused meanwhile

/** The dialog's answer; concurrent callers share one dialog. */
function askForKey(refused) {
  if (keyPrompt) return keyPrompt;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  document.getElementById("key-error").hidden = !refused;
  keyPrompt = new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        keyPrompt = null;
        sessionStorage.setItem(KEY_STORAGE, input.value);
        document.getElementById("key-button").hidden = false;
        resolve(input.value);
      },
      { once: true },
    );
  });
  dialog.showModal();
  input.focus();
  return keyPrompt;
}

/** fetch() with the API key, if one is known; on 401 asks for the key and retries. */
export async function apiFetch(path, options = {}) {
  let refused = false;
  for (;;) {
    const key = sessionStorage.getItem(KEY_STORAGE);
    const headers = { ...(options.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    await askForKey(refused || Boolean(key));
    refused = true;
  }
}

async function modelName() {
  const response = await apiFetch("/v1/models");
  if (!response.ok) return null;
  const body = await response.json();
  return body.data[0].id;
}

async function start() {
  document.getElementById("key-button").addEventListener("click", () => askForKey(false));
  document.getElementById("key-button").hidden = !sessionStorage.getItem(KEY_STORAGE);
  const name = await modelName();
  document.getElementById("model-name").textContent = name || "model not ready";
  const chat = new Chat(document.getElementById("chat"), name, apiFetch);
  chat.open();
  new Dashboard(document.getElementById("dashboard"), apiFetch).connect();
}

start();
