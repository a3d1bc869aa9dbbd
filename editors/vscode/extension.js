// The plandsl extension: .plan files get the TextMate grammar (package.json) and the language server,
// `plandsl lsp`, started over stdio by vscode-languageclient (the command is the `plandsl.server.command`
// setting, `plandsl lsp` by default: the `plandsl` of the environment the package is installed in).
const vscode = require("vscode");
const { LanguageClient } = require("vscode-languageclient/node");

let client;

function activate(context) {
  const [command, ...args] = vscode.workspace.getConfiguration("plandsl").get("server.command", ["plandsl", "lsp"]);
  client = new LanguageClient(
    "plandsl",
    "plandsl language server",
    { command, args },
    { documentSelector: [{ scheme: "file", language: "plandsl" }, { scheme: "untitled", language: "plandsl" }] },
  );
  context.subscriptions.push(client);
  return client.start();
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
