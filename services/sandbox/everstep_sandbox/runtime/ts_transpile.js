// TypeScript "compile" of the sandbox: transpile only (no type check), like ts-node's
// --transpile-only or tsx. Syntax errors are compile errors. esModuleInterop, as tsx does: a default
// import of a CommonJS module (`import assert from "assert"`) is its module.exports. Usage: node ts_transpile.js TS_MODULE SRC OUT
const [typescriptModule, source, output] = process.argv.slice(2);
const ts = require(typescriptModule);
const fs = require("fs");
const result = ts.transpileModule(fs.readFileSync(source, "utf8"), {
  reportDiagnostics: true,
  fileName: source,
  compilerOptions: { target: ts.ScriptTarget.ES2020, module: ts.ModuleKind.CommonJS, esModuleInterop: true },
});
const host = { getCanonicalFileName: (f) => f, getCurrentDirectory: () => process.cwd(), getNewLine: () => "\n" };
if (result.diagnostics && result.diagnostics.length) {
  process.stderr.write(ts.formatDiagnostics(result.diagnostics, host));
  process.exit(1);
}
fs.writeFileSync(output, result.outputText);
