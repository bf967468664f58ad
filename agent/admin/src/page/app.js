// The status page's live refresh (served at /ui/app.js). The page is complete without it:
// this only fetches the same server-rendered figures again and swaps them in, so the page and
// /status keep one source. Same origin only; nothing else is loaded.
"use strict";
(function () {
  const main = document.getElementById("status");
  const note = document.getElementById("refresh");
  const every = Number(document.body.dataset.refreshMs) || 2000;
  let refreshes = 0;
  note.textContent = "live: refreshing every " + every / 1000 + " s";
  note.className = "live";
  async function refresh() {
    try {
      const r = await fetch("/ui/fragment", { cache: "no-store" });
      if (!r.ok) {
        throw new Error("HTTP " + r.status);
      }
      // Server-rendered, escaped HTML from this origin.
      main.innerHTML = await r.text();
      refreshes += 1;
      document.body.dataset.refreshes = String(refreshes);
      note.textContent = "live: updated " + new Date().toLocaleTimeString();
      note.className = "live";
    } catch (e) {
      note.textContent = "the agent does not answer (" + e.message + "); retrying";
      note.className = "stale";
    }
  }
  setInterval(refresh, every);
})();
