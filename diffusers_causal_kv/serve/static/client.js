// The stream server's client: one WebSocket to /ws on the page's own server, the protocol of docs/serving.md.
// A chunk arrives as a JSON "chunk" message followed by one binary message (a PNG) per video frame.
"use strict";

const $ = (id) => document.getElementById(id);
const token = new URLSearchParams(location.search).get("token");
const wsUrl = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws` +
  (token ? `?token=${encodeURIComponent(token)}` : "");
let socket = null;
let expecting = null; // the chunk whose frames are arriving: {header, left}
let shownUrl = null;
let framesShown = 0;

function log(text) {
  const item = document.createElement("li");
  item.textContent = text;
  $("log").prepend(item);
}

function setStreaming(streaming) {
  $("start").disabled = streaming;
  $("switch").disabled = !streaming;
  $("stop").disabled = !streaming;
}

function show(blob) {
  const url = URL.createObjectURL(blob);
  $("frame").src = url;
  if (shownUrl) URL.revokeObjectURL(shownUrl);
  shownUrl = url;
  framesShown += 1;
}

function onMessage(event) {
  if (typeof event.data !== "string") { // a frame of the chunk announced last
    show(new Blob([event.data], { type: "image/png" }));
    expecting.left -= 1;
    const h = expecting.header;
    $("status").textContent = `streaming · chunk ${h.chunk} · video frame ${h.video_frames[0] + h.frames - expecting.left - 1}` +
      ` · frames shown ${framesShown} · prompt: ${h.prompt}`;
    return;
  }
  const message = JSON.parse(event.data);
  switch (message.type) {
    case "chunk":
      expecting = { header: message, left: message.frames };
      log(`chunk ${message.chunk} · video frames ${message.video_frames[0]}-${message.video_frames[1] - 1}` +
        ` · ${(message.seconds * 1000).toFixed(0)} ms · prompt: ${message.prompt}` +
        (message.dropped ? ` · ${message.dropped} chunks dropped` : ""));
      break;
    case "started":
      setStreaming(true);
      $("status").textContent = `started ${message.session} · cache ${(message.cache_bytes / 2 ** 20).toFixed(1)} MiB`;
      log(`started ${message.session}`);
      break;
    case "switched":
      log(`switched from chunk ${message.from_chunk} to: ${message.prompt}`);
      break;
    case "stopped":
    case "done":
      setStreaming(false);
      $("status").textContent = `${message.type} after ${message.chunks} chunks`;
      log($("status").textContent);
      break;
    case "error":
      if (!["bad_value", "bad_json", "too_large", "unknown_field", "not_streaming"].includes(message.code)) {
        setStreaming(false);
      }
      $("status").textContent = `error (${message.code}): ${message.message}`;
      log($("status").textContent);
      break;
  }
}

function numberOf(id) {
  const value = $(id).value;
  return value === "" ? undefined : Number(value);
}

function send(message) {
  socket.send(JSON.stringify(message));
}

$("start").addEventListener("click", () => {
  const message = { type: "start", prompt: $("prompt").value, seed: numberOf("seed") ?? 0 };
  for (const name of ["height", "width", "num_frames"]) {
    if (numberOf(name) !== undefined) message[name] = numberOf(name);
  }
  framesShown = 0;
  send(message);
});
$("switch").addEventListener("click", () => send({ type: "switch", prompt: $("prompt").value }));
$("stop").addEventListener("click", () => send({ type: "stop" }));

async function connect() {
  const health = await (await fetch("/health")).json();
  $("height").value = health.default_size[0];
  $("width").value = health.default_size[1];
  socket = new WebSocket(wsUrl);
  socket.binaryType = "blob";
  socket.addEventListener("message", onMessage);
  socket.addEventListener("open", () => { $("status").textContent = "connected: press Start"; });
  socket.addEventListener("close", () => { setStreaming(false); $("status").textContent = "disconnected"; });
}

connect();
