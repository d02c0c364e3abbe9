// A small, safe Markdown renderer for model replies: everything is HTML-escaped first, then
// fenced and inline code, headings, lists, emphasis and paragraphs become markup. No links
// or images, so a reply can never load anything.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

/** Inline markup of one (already escaped) line. */
function inline(text) {
  return text
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>");
}

/** One block of lines that holds no fenced code. */
function blocks(lines) {
  const out = [];
  let list = null; // "ul" | "ol" while inside a list
  let paragraph = [];
  const flushParagraph = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    paragraph = [];
  };
  const closeList = () => {
    if (list) out.push(`</${list}>`);
    list = null;
  };
  for (const line of lines) {
    const heading = line.match(/^(#{1,4})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flushParagraph();
      closeList();
      const level = heading[1].length + 2; // h3..h6: replies sit inside the page
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
    } else if (bullet || numbered) {
      flushParagraph();
      const kind = bullet ? "ul" : "ol";
      if (list !== kind) {
        closeList();
        out.push(`<${kind}>`);
        list = kind;
      }
      out.push(`<li>${inline((bullet || numbered)[1])}</li>`);
    } else if (!line.trim()) {
      flushParagraph();
      closeList();
    } else {
      closeList();
      paragraph.push(line);
    }
  }
  flushParagraph();
  closeList();
  return out.join("");
}

/** HTML for a Markdown ``source`` (complete or still streaming: an open fence renders). */
export function renderMarkdown(source) {
  const parts = escapeHtml(source).split(/^```[^\n]*$/m);
  // Even parts are prose, odd parts are code between fences.
  return parts
    .map((part, i) =>
      i % 2 ? `<pre><code>${part.replace(/^\n|\n$/g, "")}</code></pre>` : blocks(part.split("\n")),
    )
    .join("");
}
