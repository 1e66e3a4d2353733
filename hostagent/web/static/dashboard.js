/* hostagent dashboard: times in the viewer's zone (one format, the zone in the text), live refresh (fetch JSON, no
   full reload), ages and countdowns that tick between refreshes, uPlot charts whose window slides with the clock,
   confirmations. Everything here is progressive: the pages are complete without it. No inline script (CSP:
   script-src 'self'). The texts mirror hostagent/web/dashboard_format.py (duration, countdown, age, heartbeat). */
(function () {
  "use strict";
  document.documentElement.classList.add("js");
  var body = document.body;
  // dashboard.refresh_s (the overview, a lease, reclaim); the leases table and a GPU's page, costlier, every 2x
  var REFRESH_MS = Math.max(500, parseFloat(body.dataset.refreshMs) || 5000);
  var STALE_AFTER = parseFloat(body.dataset.staleAfter) || 60;  // dashboard.stale_after_s
  var skew = 0;  // the agent's clock minus the browser's, in seconds: ages and countdowns follow the agent's clock
  function syncClock(serverNow) { if (isFinite(serverNow)) skew = serverNow - Date.now() / 1000; }
  function now() { return Date.now() / 1000 + skew; }
  syncClock(parseFloat(body.dataset.now));

  // ---- one time format: 2024-05-01 10:03:07 EDT (24-hour, to the second, the zone in the text) -----------------
  var zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
  var partsFmt = new Intl.DateTimeFormat("en-US", { year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit",
    minute: "2-digit", second: "2-digit", hourCycle: "h23", timeZoneName: "short" });
  function parts(d) {
    var out = {};
    partsFmt.formatToParts(d).forEach(function (p) { out[p.type] = p.value; });
    if (out.hour === "24") out.hour = "00";
    return out;
  }
  function fmtTime(d, style) {
    var p = parts(d);
    var hm = p.hour + ":" + p.minute, ymd = p.year + "-" + p.month + "-" + p.day;
    switch (style) {
      case "time": return hm + ":" + p.second + " " + p.timeZoneName;
      case "hm": return hm;
      case "short": return p.month + "-" + p.day + " " + hm;
      default: return ymd + " " + hm + ":" + p.second + " " + p.timeZoneName;
    }
  }
  var zoneName = parts(new Date()).timeZoneName;

  function localiseTimes(root) {
    root.querySelectorAll("time[datetime]").forEach(function (el) {
      var d = new Date(el.getAttribute("datetime"));
      if (isNaN(d)) return;
      el.textContent = fmtTime(d, el.dataset.style);
      el.title = el.getAttribute("datetime") + " (shown in " + zone + ")";
    });
    root.querySelectorAll(".tz-name").forEach(function (el) { el.textContent = zoneName + " (" + zone + ")"; });
  }

  // ---- durations, countdowns, ages, heartbeats (as dashboard_format.py words them) -------------------------------
  function pad(n) { return n < 10 ? "0" + n : "" + n; }
  function dur(seconds) {
    var s = Math.floor(Math.max(0, seconds));
    var d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60), sec = s % 60;
    if (d) return d + "d " + h + "h";
    if (h) return h + "h " + pad(m) + "m";
    if (m) return m + "m " + pad(sec) + "s";
    return sec + "s";
  }
  function countdownText(deadline, t) {
    var left = deadline - t;
    if (Math.abs(left) < 1) return "now";
    return left > 0 ? "in " + dur(left) : dur(-left) + " overdue";
  }
  function heartbeatView(last, since, t) {
    if (!isFinite(last)) {
      return { state: t - since <= STALE_AFTER ? "waiting" : "never", text: "no heartbeat yet" };
    }
    var age = Math.max(0, t - last);
    if (age > STALE_AFTER) return { state: "stale", text: "no heartbeat for " + dur(age) };
    return { state: "ok", text: "heartbeat " + dur(age) + " ago" };
  }

  function tick(root) {
    var t = now();
    (root || document).querySelectorAll("[data-countdown]").forEach(function (el) {
      var deadline = parseFloat(el.dataset.countdown);
      el.textContent = "(" + countdownText(deadline, t) + ")";
      el.classList.toggle("overdue", t - deadline >= 1);
    });
    (root || document).querySelectorAll("[data-age-from]").forEach(function (el) {
      var age = Math.max(0, t - parseFloat(el.dataset.ageFrom));
      el.textContent = dur(age) + " ago";
      var box = el.closest("[data-fresh]") || el;
      // a fleet host is stale past its own bound (3 publish intervals), a figure past dashboard.stale_after_s
      box.classList.toggle("stale", age > (parseFloat(box.dataset.staleAfter) || STALE_AFTER));
    });
    (root || document).querySelectorAll("[data-hb-since]").forEach(function (el) {
      var v = heartbeatView(parseFloat(el.dataset.hbLast), parseFloat(el.dataset.hbSince), t);
      if (el.textContent !== v.text) el.textContent = v.text;
      el.className = "hb hb-" + v.state;
    });
  }

  function placeTicks(root) {
    root.querySelectorAll(".timeline-labels span[data-x]").forEach(function (el) {
      el.style.left = (parseFloat(el.dataset.x) / 10) + "%";
    });
  }

  function decorate(root) { localiseTimes(root); placeTicks(root); tick(root); }

  document.addEventListener("submit", function (ev) {
    var form = ev.target;
    if (form.classList && form.classList.contains("js-confirm") && !window.confirm(form.dataset.confirm || "Are you sure?")) {
      ev.preventDefault();
    }
  });

  var live = document.getElementById("live");
  function mark(ok) { if (live) { live.classList.toggle("on", ok); live.classList.toggle("err", !ok); } }

  function getJSON(url) {
    return fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } }).then(function (r) {
      if (r.status === 401) { window.location.href = "/ui/login?next=" + encodeURIComponent(location.pathname + location.search); throw new Error("logged out"); }
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    }).then(function (data) { if (data && data.now) syncClock(data.now); return data; });
  }

  function every(ms, fn) {
    var busy = false;
    var timer = setInterval(function () {
      if (document.hidden || busy) return;
      busy = true;
      fn().then(function (stop) { mark(true); if (stop === "stop") clearInterval(timer); }, function () { mark(false); })
        .then(function () { busy = false; });
    }, ms);
  }

  // ---- charts (uPlot): the x range is the page's window, moved to the agent's now on every refresh --------------
  var charts = [];

  function seriesFor(el, all) {
    var keys = Object.keys(all || {});
    var key = el.dataset.gpu || keys[0];
    return all && all[key];
  }

  function chartData(el, s) {
    return [s.ts, el.dataset.kind === "mem" ? s.mem_gib : s.util];
  }

  function axisTime(u, splits, axisIdx, space, incr) {
    var span = u.scales.x.max - u.scales.x.min;
    return splits.map(function (v) {
      if (v == null) return "";
      var p = parts(new Date(v * 1000)), hm = p.hour + ":" + p.minute;
      if (incr < 60) return hm + ":" + p.second;
      if (incr >= 86400) return p.month + "-" + p.day;
      return span > 86400 * 1.5 ? p.month + "-" + p.day + " " + hm : hm;
    });
  }

  function note(c, u) {  // what the chart shows, readable from the page (and by the browser tests)
    var ys = u.data[1] || [], n = 0;
    for (var i = 0; i < ys.length; i++) if (ys[i] != null) n++;
    c.el.dataset.points = n;
    c.el.dataset.xMin = Math.round(u.scales.x.min);
    c.el.dataset.xMax = Math.round(u.scales.x.max);
    c.el.dataset.xTicks = ((u.axes[0] && u.axes[0]._values) || []).join("|");  // the x axis's labels, as drawn
    var empty = c.el.parentNode.querySelector(".chart-empty" + (c.el.dataset.gpu ? "[data-gpu='" + c.el.dataset.gpu + "']" : ""));
    if (empty) empty.hidden = n > 0;
  }

  function chartWidth(el) { return Math.max(200, el.clientWidth); }

  function windowOf(el) { return { min: parseFloat(el.dataset.since), max: parseFloat(el.dataset.until) }; }

  function slide(c) {  // show the page's window (since..until), unless the operator zoomed in
    if (!c.zoomed) c.u.setScale("x", windowOf(c.el));
  }

  function makeChart(el, s) {
    if (!window.uPlot || !s) return null;
    var kind = el.dataset.kind;
    var color = kind === "mem" ? "#8250df" : "#0969da";
    var unit = kind === "mem" ? " GiB" : "%";
    var c = { el: el, u: null, zoomed: false };
    var opts = {
      width: chartWidth(el), height: 180,
      scales: {
        x: { time: true, auto: false, min: windowOf(el).min, max: windowOf(el).max },
        y: kind === "mem" ? { range: function (u, lo, hi) { return [0, Math.max(1, hi * 1.1)]; } } : { range: [0, 100] }
      },
      axes: [{ space: 70, values: axisTime },
             { size: 64, values: function (u, vals) { return vals.map(function (v) { return (+v.toFixed(1)) + unit; }); } }],
      series: [{ value: function (u, v) { return v == null ? "—" : fmtTime(new Date(v * 1000), "datetime"); } },
               { label: kind === "mem" ? "memory used" : "utilization", stroke: color, width: 1.5,
                 fill: kind === "mem" ? "rgba(130,80,223,0.12)" : "rgba(9,105,218,0.12)", spanGaps: false,
                 value: function (u, v) { return v == null ? "—" : v.toFixed(1) + unit; } }],
      legend: { show: true },
      // drag to zoom in; a double-click goes back to the sliding window (uPlot's own would fit the data instead)
      cursor: { drag: { x: true, y: false }, bind: { dblclick: function () {
        return function () { c.zoomed = false; slide(c); return null; };
      } } },
      hooks: {
        setScale: [function (u, key) {
          if (key !== "x") return;
          // a drag zoomed in (the window no longer spans since..until): refreshes keep the zoom until a double-click
          c.zoomed = Math.abs(u.scales.x.min - parseFloat(el.dataset.since)) > 1 ||
                     Math.abs(u.scales.x.max - parseFloat(el.dataset.until)) > 1;
        }],
        draw: [function (u) { note(c, u); }]
      }
    };
    c.u = new window.uPlot(opts, chartData(el, s), el);
    slide(c);
    el.classList.add("drawn");
    charts.push(c);
    note(c, c.u);
    return c;
  }

  function drawCharts() {
    var node = document.getElementById("series-data");
    if (!node) return;
    var all = JSON.parse(node.textContent);
    document.querySelectorAll(".chart").forEach(function (el) { makeChart(el, seriesFor(el, all)); });
  }

  function updateCharts(all) {
    charts.forEach(function (c) {
      var s = seriesFor(c.el, all);
      if (!s) return;
      c.el.dataset.since = s.since;
      c.el.dataset.until = s.until;
      c.u.setData(chartData(c.el, s), false);
      slide(c);  // x moves on to the new since..until (the agent's now)
      c.u.redraw(false, true);
    });
  }

  window.addEventListener("resize", function () {
    charts.forEach(function (c) { c.u.setSize({ width: chartWidth(c.el), height: 180 }); });
  });

  // ---- pages --------------------------------------------------------------------------------------------------
  function swap(el, html) { el.innerHTML = html; decorate(el); }

  var pages = {
    overview: function () {
      var box = document.getElementById("overview-body");
      if (!box) return;
      every(REFRESH_MS, function () {
        return getJSON(box.dataset.refresh).then(function (data) { swap(box, data.html); });
      });
    },
    leases: function () {
      var rows = document.getElementById("lease-rows");
      if (!rows) return;
      every(2 * REFRESH_MS, function () {
        return getJSON(rows.dataset.refresh).then(function (data) {
          swap(rows, data.html);
          var shown = document.querySelector("[data-shown]"), total = document.querySelector("[data-total]");
          if (shown && data.shown != null) shown.textContent = data.shown;
          if (total && data.total != null) total.textContent = data.total;
        });
      });
    },
    gpu: function () {
      drawCharts();
      var card = document.getElementById("timeline-card"), tl = document.getElementById("timeline");
      var head = document.getElementById("gpu-head");
      if (!card) return;
      every(2 * REFRESH_MS, function () {
        return getJSON(card.dataset.refresh).then(function (data) {
          var all = {}; all[data.series.gpu_id] = data.series;
          updateCharts(all);
          swap(tl, data.timeline);
          if (head && data.head) swap(head, data.head);
        });
      });
    },
    lease: function () {
      drawCharts();
      var head = document.getElementById("lease-head");
      if (!head) return;
      var state = head.dataset.state;
      if (["RELEASED", "EXPIRED", "FAILED"].indexOf(state) >= 0) return;
      every(REFRESH_MS, function () {
        return getJSON(head.dataset.refreshLease).then(function (data) {
          // a new state can bring GPUs (a queued request granted): the whole page then, else its parts
          if (data.state !== state) { window.location.reload(); return "stop"; }
          swap(head, data.head);
          updateCharts(data.series);
        });
      });
    },
    fleet: function () {
      var box = document.getElementById("fleet-body");
      if (!box) return;
      every(REFRESH_MS, function () {
        return getJSON(box.dataset.refresh).then(function (data) { swap(box, data.html); });
      });
    },
    reclaim: function () {
      var box = document.getElementById("reclaim-body");
      if (!box) return;
      every(REFRESH_MS, function () {
        return getJSON(box.dataset.refresh).then(function (data) { swap(box, data.html); });
      });
    }
  };

  function start() {
    decorate(document);
    setInterval(function () { if (!document.hidden) tick(document); }, 1000);
    var page = body.dataset.page;
    if (pages[page]) pages[page]();
    mark(true);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
