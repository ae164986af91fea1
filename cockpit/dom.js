/* Small DOM helpers of the GPUs page: text always goes in as text, never as
 * markup (claimant names and reasons come from the host), and times in words. */

export function h(tag, attributes, ...children) {
    const element = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes || {})) {
        if (value === null || value === undefined || value === false)
            continue;
        if (key.startsWith("on"))
            element.addEventListener(key.slice(2), value);
        else if (key === "class")
            element.className = value;
        else
            element.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
        if (child === null || child === undefined || child === false)
            continue;
        element.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return element;
}

export function $(id) {
    return document.getElementById(id);
}

export function safeId(text) {
    return text.replace(/[^A-Za-z0-9_-]/g, "_");
}

/* Re-rendering replaces elements; a keyboard user keeps the focus on the same control. */
export function keepingFocus(render) {
    const focused = document.activeElement && document.activeElement.id;
    render();
    if (focused && document.activeElement === document.body && $(focused))
        $(focused).focus();
}

function pad(number) {
    return String(number).padStart(2, "0");
}

export function localTime(iso) {
    const date = new Date(iso);
    if (Number.isNaN(date.getTime()))
        return iso;
    return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
        `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

export function ago(iso) {
    const seconds = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (Number.isNaN(seconds))
        return "";
    if (seconds < 60)
        return "just now";
    if (seconds < 3600)
        return `${Math.floor(seconds / 60)} min ago`;
    if (seconds < 86400)
        return `${Math.floor(seconds / 3600)} h ago`;
    return `${Math.floor(seconds / 86400)} days ago`;
}

export function when(iso) {
    return h("time", { datetime: iso, title: iso }, `${localTime(iso)} (${ago(iso)})`);
}

export function listing(items) {
    if (items.length === 0)
        return "";
    if (items.length === 1)
        return items[0];
    return `${items.slice(0, -1).join(", ")} and ${items[items.length - 1]}`;
}

export function sentences(failure) {
    return h("div", { class: "ca-sentences" }, failure.sentences.map(text => h("p", {}, text)));
}

export function pending(text) {
    return h("p", { class: "ca-muted ca-pending" }, h("span", { class: "ca-spinner", "aria-hidden": "true" }), text);
}
