/* hostagent dashboard: local times, live refresh (fetch JSON, no full reload), uPlot charts, confirmations.
   Everything here is progressive: the pages are complete without it. No inline script (CSP: script-src 'self'). */
(function () {
  "use strict";
  document.documentElement.classList.add("js");
  var REFRESH_MS = { overview: 5000, leases: 10000, gpu: 15000, lease: 10000 };

  var fmt = {
    datetime: new Intl.DateTimeFormat(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" }),
    time: new Intl.DateTimeFormat(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit" }),
    short: new Intl.DateTimeFormat(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" }),
    hm: new Intl.DateTimeFormat(undefined, { hour: "2-digit", minute: "2-digit" })
  };
  var zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";

  function localiseTimes(root) {
    (root || document).querySelectorAll("time[datetime]").forEach(function (el) {
      var d = new Date(el.getAttribute("datetime"));
      if (isNaN(d)) return;
      var f = fmt[el.dataset.style] || fmt.datetime;
      el.textContent = f.format(d);
      el.title = el.getAttribute("datetime") + " (shown in " + zone + ")";
    });
  }

  function placeTicks(root) {
    (root || document).querySelectorAll(".timeline-labels span[data-x]").forEach(function (el) {
      el.style.left = (parseFloat(el.dataset.x) / 10) + "%";
    });
  }

  function decorate(root) { localiseTimes(root); placeTicks(root); }

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
    });
  }

  function every(ms, fn) {
    var busy = false;
    setInterval(function () {
      if (document.hidden || busy) return;
      busy = true;
      fn().then(function () { mark(true); }, function () { mark(false); }).then(function () { busy = false; });
    }, ms);
  }

  // ---- charts (uPlot) ---------------------------------------------------------------------------------------
  var charts = [];

  function seriesFor(el, all) {
    var keys = Object.keys(all || {});
    var key = el.dataset.gpu || keys[0];
    return all && all[key];
  }

  function chartData(el, s) {
    var kind = el.dataset.kind;
    return [s.ts, kind === "mem" ? s.mem_gib : s.util];
  }

  function makeChart(el, s) {
    if (!window.uPlot || !s) return null;
    var kind = el.dataset.kind;
    var since = parseFloat(el.dataset.since), until = parseFloat(el.dataset.until);
    var color = kind === "mem" ? "#8250df" : "#0969da";
    var opts = {
      width: Math.max(300, el.clientWidth), height: 180,
      scales: { x: { time: true, range: function () { return [since, until]; } },
                y: kind === "mem" ? { range: function (u, lo, hi) { return [0, Math.max(1, hi * 1.1)]; } } : { range: [0, 100] } },
      axes: [{}, { size: 64, values: function (u, vals) { return vals.map(function (v) { return (+v.toFixed(1)) + (kind === "mem" ? " GiB" : "%"); }); } }],
      series: [{}, { label: kind === "mem" ? "memory used" : "utilization", stroke: color, width: 1.5,
                     fill: kind === "mem" ? "rgba(130,80,223,0.12)" : "rgba(9,105,218,0.12)", spanGaps: false,
                     value: function (u, v) { return v == null ? "—" : v.toFixed(1) + (kind === "mem" ? " GiB" : "%"); } }],
      legend: { show: true }, cursor: { drag: { x: true, y: false } }
    };
    var u = new window.uPlot(opts, chartData(el, s), el);
    el.classList.add("drawn");
    charts.push({ el: el, u: u });
    return u;
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
      if (s) c.u.setData(chartData(c.el, s), false);
      c.u.redraw(false, true);
    });
  }

  window.addEventListener("resize", function () {
    charts.forEach(function (c) { c.u.setSize({ width: Math.max(300, c.el.clientWidth), height: 180 }); });
  });

  // ---- pages --------------------------------------------------------------------------------------------------
  var pages = {
    overview: function () {
      var box = document.getElementById("overview-body");
      if (!box) return;
      every(REFRESH_MS.overview, function () {
        return getJSON(box.dataset.refresh).then(function (data) { box.innerHTML = data.html; decorate(box); });
      });
    },
    leases: function () {
      var body = document.getElementById("lease-rows");
      if (!body) return;
      every(REFRESH_MS.leases, function () {
        return getJSON(body.dataset.refresh).then(function (data) {
          body.innerHTML = data.html;
          var shown = document.querySelector("[data-shown]"), total = document.querySelector("[data-total]");
          if (shown) shown.textContent = data.shown;
          if (total) total.textContent = data.total;
          decorate(body);
        });
      });
    },
    gpu: function () {
      drawCharts();
      var card = document.getElementById("timeline-card"), tl = document.getElementById("timeline");
      if (!card) return;
      every(REFRESH_MS.gpu, function () {
        return getJSON(card.dataset.refresh).then(function (data) {
          var all = {}; all[data.series.gpu_id] = data.series;
          charts.forEach(function (c) { c.el.dataset.until = data.series.until; });
          updateCharts(all);
          tl.innerHTML = data.timeline; decorate(tl);
        });
      });
    },
    lease: function () {
      drawCharts();
      var head = document.querySelector("[data-refresh-lease]");
      if (!head) return;
      var state = head.dataset.state;
      if (["RELEASED", "EXPIRED", "FAILED"].indexOf(state) >= 0) return;
      every(REFRESH_MS.lease, function () {
        return getJSON(head.dataset.refreshLease).then(function (data) {
          if (data.state !== state) { window.location.reload(); return; }
          updateCharts(data.series);
        });
      });
    }
  };

  function start() {
    decorate(document);
    var page = document.body.dataset.page;
    if (pages[page]) pages[page]();
    mark(true);
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start); else start();
})();
