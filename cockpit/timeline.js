/* The history as a picture: one lane per claimant or stopped holder, a bar for
 * each time it held a GPU (exclusive or shared) or was kept stopped for another,
 * and a mark for each refusal, failure, poisoning and interrupted step.
 *
 * `buildTimeline` is pure (events from `history --json` in, lanes out) so that
 * the drawing only draws; `drawTimeline` makes the SVG at the width it is given. */

const SVG = "http://www.w3.org/2000/svg";

const ENDS = new Set(["release", "restore", "failed"]);

function seconds(text) {
    return new Date(text).getTime() / 1000;
}

export function buildTimeline(events, now) {
    const lanes = new Map();
    const lane = name => {
        if (!lanes.has(name))
            lanes.set(name, { name, bars: [], marks: [], open: null, sharedBeforeStop: null });
        return lanes.get(name);
    };
    const close = (entry, time) => {
        if (entry.open) {
            entry.open.end = time;
            entry.bars.push(entry.open);
            entry.open = null;
        }
    };
    for (const event of events) {
        const time = seconds(event.time);
        if (Number.isNaN(time))
            continue;
        const claimant = event.claimant;
        const holder = event.holder;
        const tokens = (event.token || "").split(",").filter(Boolean);
        switch (event.event) {
        case "claim": {
            const entry = lane(claimant);
            close(entry, time);
            entry.open = { start: time, end: null, kind: event.mode, tokens, label: tokens.join(", ") };
            break;
        }
        case "refused":
            lane(claimant).marks.push({ time, kind: "refused", title: event.message || event.why || "refused" });
            break;
        case "poisoned":
            lane(claimant || tokens.join(", ")).marks.push({ time, kind: "poisoned", title: event.message || "poisoned" });
            break;
        case "preempted": {
            const entry = lane(holder);
            if (entry.open && entry.open.kind === "shared")
                entry.sharedBeforeStop = entry.open.tokens;
            close(entry, time);
            entry.open = { start: time, end: null, kind: "stopped", tokens: [], label: `stopped for ${claimant}` };
            break;
        }
        case "restored": {
            const entry = lane(holder);
            close(entry, time);
            if (entry.sharedBeforeStop) {
                const back = entry.sharedBeforeStop;
                entry.open = { start: time, end: null, kind: "shared", tokens: back, label: back.join(", ") };
                entry.sharedBeforeStop = null;
            }
            break;
        }
        case "restore-failed":
            lane(holder).marks.push({ time, kind: "failed", title: event.message || "could not start again" });
            break;
        default:
            if (ENDS.has(event.event) && claimant) {
                const entry = lane(claimant);
                const wasOpen = entry.open !== null;
                close(entry, time);
                // `restore` ends a lease with a "failed" event whose reason is "restored".
                if (event.event === "failed" && event.why !== "restored" && (wasOpen || event.why))
                    entry.marks.push({ time, kind: "failed", title: event.message || "failed" });
            }
        }
        if (event.interrupted && claimant)
            lane(claimant).marks.push({ time, kind: "interrupted", title: `${event.message} (the process died here)` });
    }
    const times = events.map(event => seconds(event.time)).filter(time => !Number.isNaN(time));
    let start = times.length ? Math.min(...times) : now - 3600;
    let end = Math.max(now, ...times);
    if (end - start < 10)
        start = end - 10;
    const pad = (end - start) * 0.03;
    start -= pad;
    end += pad;
    const result = [];
    for (const entry of lanes.values()) {
        if (entry.open) {
            entry.open.end = now;
            entry.open.ongoing = true;
            entry.bars.push(entry.open);
        }
        result.push({ name: entry.name, bars: entry.bars, marks: entry.marks });
    }
    return { start, end, now, lanes: result };
}

const STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

function two(number) {
    return String(number).padStart(2, "0");
}

function clock(time, withSeconds) {
    const date = new Date(time * 1000);
    const text = `${two(date.getHours())}:${two(date.getMinutes())}`;
    return withSeconds ? `${text}:${two(date.getSeconds())}` : text;
}

function node(name, attributes, text) {
    const element = document.createElementNS(SVG, name);
    for (const [key, value] of Object.entries(attributes || {}))
        element.setAttribute(key, String(value));
    if (text !== undefined)
        element.textContent = text;
    return element;
}

function titled(element, title) {
    element.appendChild(node("title", {}, title));
    return element;
}

export function drawTimeline(model, width) {
    const rowHeight = 30;
    const top = 26;
    const labelWidth = Math.max(90, Math.min(190, width * 0.32));
    const left = labelWidth + 8;
    const right = width - 12;
    const height = top + Math.max(1, model.lanes.length) * rowHeight + 8;
    const x = time => left + (time - model.start) / (model.end - model.start) * (right - left);
    const svg = node("svg", {
        width, height, viewBox: `0 0 ${width} ${height}`, class: "ca-timeline", role: "img",
    });
    const span = model.end - model.start;
    const step = STEPS.find(candidate => span / candidate <= Math.max(2, (right - left) / 90)) || 86400;
    const axis = node("g", { class: "ca-timeline-axis" });
    for (let tick = Math.ceil(model.start / step) * step; tick <= model.end; tick += step) {
        axis.appendChild(node("line", { x1: x(tick), x2: x(tick), y1: top - 6, y2: height - 4 }));
        axis.appendChild(node("text", { x: x(tick), y: top - 10, "text-anchor": "middle" }, clock(tick, step < 60)));
    }
    svg.appendChild(axis);
    const nowLine = node("line", { class: "ca-timeline-now", x1: x(model.now), x2: x(model.now), y1: top - 6, y2: height - 4 });
    svg.appendChild(titled(nowLine, "now"));
    model.lanes.forEach((entry, row) => {
        const y = top + row * rowHeight;
        const group = node("g", { class: "ca-timeline-lane" });
        if (row % 2 === 1)
            group.appendChild(node("rect", { class: "ca-timeline-stripe", x: 0, y, width, height: rowHeight }));
        const fits = Math.floor(labelWidth / 6.6); // characters of 12px text in the label column
        const shown = entry.name.length > fits ? `${entry.name.slice(0, fits - 1)}\u2026` : entry.name;
        const label = node("text", { class: "ca-timeline-label", x: labelWidth, y: y + rowHeight / 2 + 4, "text-anchor": "end" }, shown);
        group.appendChild(titled(label, entry.name));
        for (const bar of entry.bars) {
            const x1 = x(bar.start);
            const barWidth = Math.max(3, x(bar.end) - x1);
            const rect = node("rect", {
                class: `ca-bar ca-bar-${bar.kind}${bar.ongoing ? " ca-bar-ongoing" : ""}`,
                x: x1, y: y + 6, width: barWidth, height: rowHeight - 12, rx: 2,
            });
            const when = `${clock(bar.start, true)}\u2013${bar.ongoing ? "now" : clock(bar.end, true)}`;
            const what = bar.kind === "stopped" ? bar.label : `${bar.kind} on ${bar.label}`;
            group.appendChild(titled(rect, `${entry.name}: ${what}, ${when}`));
            if (barWidth > bar.label.length * 7 + 8)
                group.appendChild(node("text", { class: `ca-bar-text ca-bar-text-${bar.kind}`, x: x1 + 5, y: y + rowHeight / 2 + 4 }, bar.label));
        }
        for (const mark of entry.marks) {
            const cx = x(mark.time);
            const cy = y + rowHeight / 2;
            let shape;
            if (mark.kind === "refused")
                shape = node("path", { d: `M${cx - 5},${cy - 5}L${cx + 5},${cy + 5}M${cx + 5},${cy - 5}L${cx - 5},${cy + 5}` });
            else if (mark.kind === "interrupted")
                shape = node("path", { d: `M${cx},${cy - 6}L${cx + 6},${cy}L${cx},${cy + 6}L${cx - 6},${cy}Z` });
            else
                shape = node("path", { d: `M${cx},${cy - 7}L${cx + 7},${cy + 6}L${cx - 7},${cy + 6}Z` });
            shape.setAttribute("class", `ca-mark ca-mark-${mark.kind}`);
            group.appendChild(titled(shape, `${clock(mark.time, true)} ${mark.title}`));
        }
        svg.appendChild(group);
    });
    if (!model.lanes.length)
        svg.appendChild(node("text", { class: "ca-timeline-label", x: left, y: top + 19 }, "Nothing happened in this period."));
    return svg;
}
