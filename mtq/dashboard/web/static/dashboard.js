// mtq dashboard: live sections and a task's tokens over server-sent events.
// Sections come rendered (and escaped) by the server; this swaps them in by id.
// Without JavaScript, or without EventSource, the pages work as they were loaded.
(function () {
  "use strict";
  var state = document.getElementById("live-state");
  function show(text, cls) {
    if (state) { state.textContent = text; state.className = "live-state " + cls; }
  }
  var open = [];  // closed when the page goes (a page kept in the back-forward cache
  window.addEventListener("pagehide", function () {  // would hold its connections)
    open.forEach(function (es) { es.close(); });
  });
  window.addEventListener("pageshow", function (e) {  // back from that cache: the present
    if (e.persisted) { location.reload(); }
  });
  var live = document.body.dataset.live;
  if (live && window.EventSource) {
    var es = new EventSource(live);
    open.push(es);
    es.onopen = function () { show("live", "on"); };
    es.onerror = function () { show("reconnecting", "off"); };
    es.addEventListener("fragment", function (e) {
      var f = JSON.parse(e.data);
      var old = document.getElementById(f.id);
      if (old) { old.outerHTML = f.html; }
    });
    es.addEventListener("end", function () { es.close(); show("static", ""); });
  }
  var out = document.getElementById("tokens");
  if (out && out.dataset.stream && window.EventSource) {
    var box = document.getElementById("tokens-box");
    var note = document.getElementById("tokens-state");
    var tokens = new EventSource(out.dataset.stream);
    open.push(tokens);
    tokens.addEventListener("token", function (e) {
      var tok = JSON.parse(e.data);
      out.textContent += (typeof tok === "string") ? tok : JSON.stringify(tok) + " ";
      if (box) { box.hidden = false; }
      out.dataset.count = String(Number(out.dataset.count || 0) + 1);
    });
    tokens.addEventListener("done", function (e) {
      var d = JSON.parse(e.data);
      tokens.close();
      if (note) { note.textContent = d.status + " after " + (out.dataset.count || 0) + " tokens"; }
    });
    tokens.addEventListener("error", function (e) {
      if (e.data) { var d = JSON.parse(e.data); if (!d.retry) { tokens.close(); } }
    });
  }
})();
