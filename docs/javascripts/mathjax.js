// MathJax 3 for the math that pymdownx.arithmatex (generic mode) leaves as \( \) and \[ \]
// spans. The site loads MathJax itself from a CDN (mkdocs.yml, extra_javascript): the math
// renders in a browser with a network, and stays readable TeX without one.
window.MathJax = {
  tex: { inlineMath: [["\\(", "\\)"]], displayMath: [["\\[", "\\]"]], processEscapes: true },
  options: { processHtmlClass: "arithmatex", ignoreHtmlClass: ".*" },
};
