"""Python code in a normal form that copying cannot change: what similarity.py compares.

    normal_tokens(text) -> [(token, line)]      # line: where in `text` the token came from

The text is parsed (ast) and written out as a stream of tokens, one per syntax node, with
these rewrites, so that each evasion of a copier leaves the stream as it was:

- renaming: every name the file binds (functions, classes, arguments, variables, attributes
  its own classes define) is the token ID; a module keeps its real name whatever it is
  imported as (`import numpy as xp`: `xp.rint` is numpy.rint); builtins and library
  attributes stay, they are the code's vocabulary.
- no-op statements: docstrings, comments and any expression statement without a call, `pass`,
  `x = x`, `x += 0`, `x *= 1`, assignments to names the file never reads, code after a return,
  raise, break or continue, and the dead arm of an `if` (or a `while`) whose test is a
  constant (`if False:`, `if 0:`, `if not True:`) are dropped; `x += y` is `x = x + y`.
- operand order: the operands of +, *, &, |, ^, and, or, ==, !=, is are sorted (a chain of one
  operator as a whole: a + b + c); `a > b` is `b < a`, `a >= b` is `b <= a`.
- statement order: within a block, statements that neither read nor write what the other
  writes (and are not both calls made for their effect) are put in one canonical order: the
  topological order of their dependencies that takes, of the statements free to go next, the
  one whose tokens sort first. Module-level functions and classes are such statements.
  Returns, raises, loops' exits, `try` and `global` stay where they are.

Text that does not parse (a patch's added lines, a student's syntax error) is parsed a
top-level statement at a time; what still fails becomes Python tokens with every name ID.
"""
import ast
import collections
import functools
import heapq
import io
import keyword
import textwrap
import threading
import tokenize
import traceback

MAX_BLOCK = 400          # statements of one block reordered at most (the sort is quadratic)
MAX_DEPTH = 200          # deeper syntax is cut short (hostile nesting) rather than recursed into

COMMUTATIVE = (ast.Add, ast.Mult, ast.BitAnd, ast.BitOr, ast.BitXor)
# x op IDENTITY is x (the right operand only, for the operators that are not commutative)
RIGHT_IDENTITY = {ast.Add: 0, ast.Sub: 0, ast.BitOr: 0, ast.BitXor: 0, ast.LShift: 0,
                  ast.RShift: 0, ast.Mult: 1, ast.Div: 1, ast.FloorDiv: 1, ast.Pow: 1}
SWAPPED = {ast.Gt: ast.Lt, ast.GtE: ast.LtE}
SYMMETRIC = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)
# calls that change something other than what they return (the others are taken as pure)
IMPURE_BUILTINS = {"print", "open", "exec", "eval", "setattr", "delattr", "input", "next",
                   "__import__", "exit", "quit"}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update",
            "setdefault", "add", "discard", "write", "writelines", "sort", "reverse", "fill",
            "setflags", "put", "resize", "itemset", "step", "backward", "zero_grad",
            "set_epoch", "seed", "manual_seed", "close", "flush", "start", "send", "recv",
            "train", "eval", "load_state_dict", "register_forward_hook", "copyto"}
FLOW = (ast.Return, ast.Raise, ast.Break, ast.Continue)
UNPARSABLE = (SyntaxError, ValueError, RecursionError, MemoryError)   # what hostile text raises

# CPython (3.11 here) counts the AST constructor's depth in one place per interpreter, not per
# thread: a thread that parses while another one's parse waits (in a garbage collection, say)
# makes the waiting one fail with "SystemError: AST constructor recursion depth mismatch"
# (python/cpython#106905), an error of no text. The grader grades kits in threads.
_ONE_PARSE_AT_A_TIME = threading.Lock()


def parse(text):
    """ast.parse(text), one thread at a time: every parse of the grader's goes through here."""
    with _ONE_PARSE_AT_A_TIME:
        return ast.parse(text)


def format_exc():
    """traceback.format_exc(), under parse's lock: Python 3.11's traceback parses each failing
    expression it underlines (ast.parse), which breaks another thread's parse as two parses do."""
    with _ONE_PARSE_AT_A_TIME:
        return traceback.format_exc()


def normal_tokens(text, context=None):
    """[(token, line)] of Python `text` in the normal form (the module docstring). context:
    (names, attributes) that the files of the same code bind (own_names of each, joined), so
    that what one file imports from another is a name of its own there too, and the names
    the other files read, so that an assignment is unused only where none reads it."""
    context = context or (set(), set(), set())
    return [(tok, line) for tree, offset in _trees(text) for tok, line in _written(tree, context, offset)]


def own_names(text):
    """(names, attributes) the text binds (see _Bindings), and the names it reads."""
    names, attrs, read = set(), set(), set()
    for tree, _ in _trees(text):
        if not isinstance(tree, str):
            found = _Bindings(tree)
            names |= found.own
            attrs |= found.own_attrs
            read |= _loaded(tree)
    return names, attrs, read


def _written(tree, context, offset):
    if isinstance(tree, str):
        return _python_tokens(tree, offset)
    try:
        return [(tok, line + offset) for tok, line in _Writer(tree, context).module()]
    except RecursionError:
        return [("deep", offset + 1)]


@functools.lru_cache(maxsize=64)
def _trees(text):
    """[(tree, line offset)]: the text's tree, or where it does not parse the trees of its
    groups (_groups), a group that still does not parse as its text."""
    try:
        return [(parse(text), 0)]
    except UNPARSABLE:
        pass
    out = []
    for chunk, offset in _groups(text):
        tree = _parse(chunk) or _parse(chunk + "\n    pass")
        out.append((tree if tree is not None else chunk, offset))
    return out


def _groups(text):
    """Each top-level group of lines (a line at the smallest indentation and the deeper lines
    after it), dedented, with its line offset; a header without its body (`class C(B):` whose
    body is context in a patch) gets `pass` from _trees."""
    lines = text.splitlines()
    indents = [len(l) - len(l.lstrip()) for l in lines if l.strip()]
    if not indents:
        return []
    top = min(indents)
    groups, start = [], 0
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped and len(line) - len(stripped) == top and not stripped.startswith((")", "]", "}")):
            if i > start:
                groups.append((start, i))
            start = i
    groups.append((start, len(lines)))
    return [(textwrap.dedent("\n".join(lines[a:b])), a) for a, b in groups]


def _parse(text):
    try:
        return parse(text)
    except UNPARSABLE:
        return None


def _python_tokens(text, offset):
    """Python tokens of text that does not parse: keywords and operators as they are, names
    ID, numbers N, strings S; read a line at a time where the whole does not tokenize."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            out += [(t, offset + tok.start[0]) for t in _token(tok)]
        return out
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            for tok in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
                out += [(t, offset + n) for t in _token(tok)]
        except (tokenize.TokenError, IndentationError, SyntaxError):
            continue
    return out


def _token(tok):
    if tok.type == tokenize.NAME:
        return [tok.string if keyword.iskeyword(tok.string) else "ID"]
    if tok.type == tokenize.NUMBER:
        return ["N"]
    if tok.type == tokenize.STRING:
        return ["S"]
    if tok.type == tokenize.OP:
        return [tok.string]
    return []


# ---- what the file binds -------------------------------------------------------------------
class _Bindings(ast.NodeVisitor):
    """The names a file binds itself (renamed to ID), its modules' aliases, the attributes
    its own classes and objects define, and the names it ever reads."""

    def __init__(self, tree):
        self.own, self.own_attrs, self.modules = set(), set(), {}
        self.visit(tree)

    def visit_Name(self, node):
        if not isinstance(node.ctx, ast.Load):
            self.own.add(node.id)

    def visit_arg(self, node):
        self.own.add(node.arg)
        self.generic_visit(node)

    def _def(self, node):
        self.own.add(node.name)
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _def

    def visit_ClassDef(self, node):
        self.own.add(node.name)
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.own_attrs.add(stmt.name)
            for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
                for name in ast.walk(target) if target is not None else ():
                    if isinstance(name, ast.Name):
                        self.own_attrs.add(name.id)
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if not isinstance(node.ctx, ast.Load):
            self.own_attrs.add(node.attr)
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.asname:
                self.modules[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.modules[top] = top

    def visit_ImportFrom(self, node):
        module = node.module or ""
        for alias in node.names:
            if node.level:                    # the same code's other files: its own names
                self.own.add(alias.asname or alias.name)
            else:
                self.modules[alias.asname or alias.name] = f"{module}.{alias.name}"

    def visit_ExceptHandler(self, node):
        if node.name:
            self.own.add(node.name)
        self.generic_visit(node)

    def visit_Global(self, node):
        self.own.update(node.names)

    visit_Nonlocal = visit_Global


def _loaded(tree):
    """Names read anywhere in the tree (and strings: __all__, getattr(module, "name"))."""
    return {node.id if isinstance(node, ast.Name) else node.value for node in ast.walk(tree)
            if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load))
            or (isinstance(node, ast.Constant) and isinstance(node.value, str))}


def _unused_assignments(tree, read_elsewhere):
    """ids of the assignments (to plain names only) whose names nothing reads, to a fixpoint:
    dropping one can leave another unread (what it read is read once less)."""
    reads = collections.Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads[node.id] += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            reads[node.value] += 1           # __all__, getattr(module, "name")
    assigns = [n for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))]
    dropped, changed = set(), True
    while changed:
        changed = False
        for node in assigns:
            if id(node) in dropped or not _targets_unread(node, reads, read_elsewhere):
                continue
            dropped.add(id(node))
            changed = True
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Load):
                    reads[inner.id] -= 1
                elif isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    reads[inner.value] -= 1
    return dropped


def _targets_unread(node, reads, read_elsewhere):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = [n for t in targets for n in ast.walk(t)]
    return (all(isinstance(n, (ast.Name, ast.Tuple, ast.List, ast.Starred, ast.Load, ast.Store))
                for n in names)
            and not any(isinstance(n, ast.Name) and (reads[n.id] > 0 or n.id in read_elsewhere)
                        for n in names))


# ---- constants -----------------------------------------------------------------------------
def _truth(node):
    """True/False for a test made of constants only (cheap to evaluate), else None."""
    if isinstance(node, ast.Constant):
        return bool(node.value) if isinstance(node.value, (bool, int, float, str, type(None))) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _truth(node.operand)
        return None if inner is None else not inner
    if isinstance(node, ast.BoolOp):
        values = [_truth(v) for v in node.values]
        if None in values:
            return None
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if (isinstance(node, ast.Compare) and len(node.ops) == 1
            and all(isinstance(n, ast.Constant) and isinstance(n.value, (int, float))
                    and not isinstance(n.value, bool) for n in (node.left, node.comparators[0]))):
        a, b = node.left.value, node.comparators[0].value
        op = type(node.ops[0])
        table = {ast.Eq: a == b, ast.NotEq: a != b, ast.Lt: a < b, ast.LtE: a <= b,
                 ast.Gt: a > b, ast.GtE: a >= b}
        return table.get(op)
    return None


def _same(a, b):
    """Two expressions written alike, real names and all (a store and a load of one name too)."""
    return ast.dump(a).replace("ctx=Store()", "ctx=Load()") == ast.dump(b).replace("ctx=Store()", "ctx=Load()")


def _without_identity(node):
    """e for `e + 0`, `e * 1`, `1 * e`, ..., repeatedly; else the node itself."""
    while isinstance(node, ast.BinOp):
        identity = RIGHT_IDENTITY.get(type(node.op))
        if identity is not None and _number(node.right) == identity:
            node = node.left
        elif isinstance(node.op, COMMUTATIVE) and identity is not None and _number(node.left) == identity:
            node = node.right
        else:
            break
    return node


def _number(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    return None


# ---- what a statement reads and writes (for the reordering) ---------------------------------
def _path(node):
    """'a.b.c' for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def _target_path(node):
    while isinstance(node, (ast.Subscript, ast.Starred)):
        node = node.value
    return _path(node)


class _Access:
    """reads, writes (dotted names), effect (a call made for what it does), barrier (flow
    leaves or jumps: nothing moves across it)."""

    def __init__(self, stmt):
        self.reads, self.writes = set(), set()
        self.effect = self.barrier = False
        if isinstance(stmt, FLOW + (ast.Global, ast.Nonlocal, ast.Try)) or type(stmt).__name__ == "TryStar":
            self.barrier = True
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom)):
            self.effect = True
        if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Assert, ast.Delete)):
            self.effect = True
        self._walk(stmt, top=True)

    def _walk(self, node, top=False):
        stack = [node]
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.writes.add(node.name)
                stack.extend(node.decorator_list)
                if isinstance(node, ast.ClassDef):
                    stack.extend(node.bases + [k.value for k in node.keywords])
                else:
                    stack.extend(node.args.defaults + [d for d in node.args.kw_defaults if d])
                continue                      # a body runs when called: no access now
            if isinstance(node, ast.Lambda):
                continue
            if isinstance(node, FLOW + (ast.Yield, ast.YieldFrom, ast.Await)) and not top:
                self.barrier = True
            top = False
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    self.writes.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, ast.Name):
                (self.reads if isinstance(node.ctx, ast.Load) else self.writes).add(node.id)
            elif isinstance(node, ast.Attribute) and _path(node):
                (self.reads if isinstance(node.ctx, ast.Load) else self.writes).add(_path(node))
                continue
            elif isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Load):
                path = _target_path(node)
                if path:
                    self.writes.add(path)
            elif isinstance(node, ast.Call):
                self._call(node)
            stack.extend(ast.iter_child_nodes(node))

    def _call(self, node):
        func = node.func
        if isinstance(func, ast.Name) and func.id in IMPURE_BUILTINS:
            self.effect = True
        if isinstance(func, ast.Attribute) and (func.attr in MUTATORS or
                                                (func.attr.endswith("_") and not func.attr.startswith("_"))):
            path = _path(func.value)
            if path:
                self.writes.add(path)
            else:
                self.effect = True
        for kw in node.keywords:
            if kw.arg == "out":
                path = _target_path(kw.value)
                if path:
                    self.writes.add(path)


def _overlap(xs, ys):
    for x in xs:
        for y in ys:
            if x == y or x.startswith(y + ".") or y.startswith(x + "."):
                return True
    return False


def _depends(earlier, later):
    return (_overlap(earlier.writes, later.reads | later.writes) or _overlap(earlier.reads, later.writes)
            or (earlier.effect and later.effect))


def _canonical_order(items):
    """items: [(tokens, access)] of one stretch between barriers -> tokens in the canonical
    order: topological by dependency, the smallest tokens first among the free."""
    n = len(items)
    if n < 2 or n > MAX_BLOCK:
        return [tok for toks, _ in items for tok in toks]
    after = [[] for _ in range(n)]
    waiting = [0] * n
    for i in range(n):
        for j in range(i + 1, n):
            if _depends(items[i][1], items[j][1]):
                after[i].append(j)
                waiting[j] += 1
    keys = [tuple(t for t, _ in toks) for toks, _ in items]
    free = [(keys[i], i) for i in range(n) if not waiting[i]]
    heapq.heapify(free)
    out = []
    while free:
        _, i = heapq.heappop(free)
        out += items[i][0]
        for j in after[i]:
            waiting[j] -= 1
            if not waiting[j]:
                heapq.heappush(free, (keys[j], j))
    return out


# ---- the writer ----------------------------------------------------------------------------
class _Writer:
    """Writes a module as normal-form tokens (see the module docstring)."""

    def __init__(self, tree, context):
        self.tree = tree
        self.bindings = _Bindings(tree)
        self.bindings.own |= context[0] - set(self.bindings.modules)
        self.bindings.own_attrs |= context[1]
        self.dropped = _unused_assignments(tree, context[2])
        self.depth = 0

    def module(self):
        return self.block(self.tree.body, 1)

    # -- names
    def name(self, ident):
        if ident in self.bindings.modules:
            return "M:" + self.bindings.modules[ident]
        if ident in self.bindings.own:
            return "ID"
        return "B:" + ident

    def attr(self, ident):
        return "ID" if ident in self.bindings.own_attrs else "." + ident

    def own_callee(self, func):
        """A function or method the file defines: its keyword arguments are its own names."""
        if isinstance(func, ast.Name):
            return func.id in self.bindings.own and func.id not in self.bindings.modules
        return isinstance(func, ast.Attribute) and func.attr in self.bindings.own_attrs

    # -- blocks
    def block(self, stmts, line):
        items, out = [], []
        for stmt in stmts:
            toks = self.statement(stmt)
            if toks is None:
                continue
            access = _Access(stmt)
            if access.barrier:
                out += _canonical_order(items) + toks
                items = []
            else:
                items.append((toks, access))
            if isinstance(stmt, FLOW):
                break                          # what follows never runs
        return out + _canonical_order(items)

    def body(self, stmts, line):
        return [("{", line)] + self.block(stmts, line) + [("}", line)]

    def statement(self, node):
        """Tokens of one statement, or None for a no-op."""
        line = getattr(node, "lineno", 1)
        if id(node) in self.dropped or isinstance(node, ast.Pass):
            return None
        if isinstance(node, ast.Expr):
            if not any(isinstance(n, (ast.Call, ast.Await, ast.Yield, ast.YieldFrom)) for n in ast.walk(node.value)):
                return None                    # docstrings, bare names and arithmetic
            return [("Expr", line)] + self.expr(node.value, line)
        if isinstance(node, ast.Assign):
            if (all(isinstance(t, ast.Name) for t in node.targets) and isinstance(node.value, ast.Name)
                    and all(t.id == node.value.id for t in node.targets)):
                return None                    # x = x
            if len(node.targets) == 1 and _same(node.targets[0], _without_identity(node.value)):
                return None                    # x = x + 0, x = 1 * x
            value = self.expr(node.value, line)
            return ([("=", line)] + [t for target in node.targets for t in self.expr(target, line)]
                    + [(":=", line)] + value)
        if isinstance(node, ast.AugAssign):
            if _number(node.value) is not None and RIGHT_IDENTITY.get(type(node.op)) == _number(node.value):
                return None                    # x += 0, x *= 1
            binop = ast.BinOp(left=node.target, op=node.op, right=node.value)
            return [("=", line)] + self.expr(node.target, line) + [(":=", line)] + self.expr(binop, line)
        if isinstance(node, ast.AnnAssign):
            if node.value is None:
                return None
            return [("=", line)] + self.expr(node.target, line) + [(":=", line)] + self.expr(node.value, line)
        if isinstance(node, ast.If):
            truth = _truth(node.test)
            if truth is not None:
                chosen = self.block(node.body if truth else node.orelse, line)
                return chosen or None
            out = [("if", line)] + self.expr(node.test, line) + self.body(node.body, line)
            if node.orelse:
                out += [("else", line)] + self.body(node.orelse, line)
            return out
        if isinstance(node, ast.While):
            if _truth(node.test) is False:
                return self.block(node.orelse, line) or None
            return ([("while", line)] + self.expr(node.test, line) + self.body(node.body, line)
                    + ([("else", line)] + self.body(node.orelse, line) if node.orelse else []))
        if isinstance(node, (ast.For, ast.AsyncFor)):
            return ([("for", line)] + self.expr(node.target, line) + [("in", line)]
                    + self.expr(node.iter, line) + self.body(node.body, line)
                    + ([("else", line)] + self.body(node.orelse, line) if node.orelse else []))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out = [("def", line)]
            for dec in node.decorator_list:
                out += [("@", line)] + self.expr(dec, line)
            out += self.arguments(node.args, line)
            return out + self.body(node.body, line)
        if isinstance(node, ast.ClassDef):
            out = [("class", line)]
            for dec in node.decorator_list:
                out += [("@", line)] + self.expr(dec, line)
            for base in node.bases:
                out += [("base", line)] + self.expr(base, line)
            for kw in node.keywords:
                out += [("kw", line)] + self.expr(kw.value, line)
            return out + self.body(node.body, line)
        if isinstance(node, (ast.Return, ast.Raise, ast.Assert, ast.Delete, ast.Global,
                             ast.Nonlocal, ast.Break, ast.Continue, ast.Import, ast.ImportFrom)):
            out = [(type(node).__name__, line)]
            if isinstance(node, ast.ImportFrom) and node.level:
                return None                    # the same code's other files: no library
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = getattr(node, "module", None) or ""
                return out + [("M:" + (mod + "." if mod else "") + a.name, line) for a in node.names]
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    out += self.expr(child, line)
            return out
        if isinstance(node, (ast.With, ast.AsyncWith)):
            out = [("with", line)]
            for item in node.items:
                out += self.expr(item.context_expr, line)
                if item.optional_vars is not None:
                    out += [("as", line)] + self.expr(item.optional_vars, line)
            return out + self.body(node.body, line)
        if isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            out = [("try", line)] + self.body(node.body, line)
            for handler in node.handlers:
                out += [("except", line)] + (self.expr(handler.type, line) if handler.type else [])
                out += self.body(handler.body, line)
            if node.orelse:
                out += [("else", line)] + self.body(node.orelse, line)
            if node.finalbody:
                out += [("finally", line)] + self.body(node.finalbody, line)
            return out
        # anything else (match, type aliases): its node types, in order
        return [(type(n).__name__, getattr(n, "lineno", line)) for n in ast.walk(node)]

    def arguments(self, args, line):
        out = []
        for arg in args.posonlyargs + args.args + ([args.vararg] if args.vararg else []) \
                + args.kwonlyargs + ([args.kwarg] if args.kwarg else []):
            out.append(("arg", line))          # annotations dropped: they are no logic
        for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
            out += [("default", line)] + self.expr(default, line)
        return out

    # -- expressions
    def expr(self, node, line):
        line = getattr(node, "lineno", line)
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                return [("deep", line)]
            return self._expr(node, line)
        finally:
            self.depth -= 1

    def _expr(self, node, line):
        if isinstance(node, ast.Name):
            return [(self.name(node.id), line)]
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or value is None or value is Ellipsis:
                return [(repr(value), line)]
            return [("N" if isinstance(value, (int, float, complex)) else "S", line)]
        if isinstance(node, ast.Attribute):
            return self.expr(node.value, line) + [(self.attr(node.attr), line)]
        if isinstance(node, ast.BinOp):
            identity = RIGHT_IDENTITY.get(type(node.op))
            if identity is not None and _number(node.right) == identity:
                return self.expr(node.left, line)
            if isinstance(node.op, COMMUTATIVE) and identity is not None and _number(node.left) == identity:
                return self.expr(node.right, line)
            if isinstance(node.op, COMMUTATIVE):
                operands = sorted((self.expr(o, line) for o in self._chain(node, type(node.op))),
                                  key=lambda toks: [t for t, _ in toks])
                return [(type(node.op).__name__ + str(len(operands)), line)] + [t for o in operands for t in o]
            return [(type(node.op).__name__, line)] + self.expr(node.left, line) + self.expr(node.right, line)
        if isinstance(node, ast.BoolOp):
            operands = sorted((self.expr(v, line) for v in node.values), key=lambda toks: [t for t, _ in toks])
            return [(type(node.op).__name__ + str(len(operands)), line)] + [t for o in operands for t in o]
        if isinstance(node, ast.Compare):
            if len(node.ops) == 1:
                op, left, right = type(node.ops[0]), node.left, node.comparators[0]
                if op in SWAPPED:
                    op, left, right = SWAPPED[op], right, left
                sides = [self.expr(left, line), self.expr(right, line)]
                if issubclass(op, SYMMETRIC):
                    sides.sort(key=lambda toks: [t for t, _ in toks])
                return [(op.__name__, line)] + sides[0] + sides[1]
            out = [("Compare", line)] + self.expr(node.left, line)
            for op, right in zip(node.ops, node.comparators):
                out += [(type(op).__name__, line)] + self.expr(right, line)
            return out
        if isinstance(node, ast.Call):
            out = [("Call", line)] + self.expr(node.func, line)
            for arg in node.args:
                out += self.expr(arg, line)
            own = self.own_callee(node.func)
            for kw in sorted(node.keywords, key=lambda k: k.arg or ""):
                label = "**" if kw.arg is None else "ID" if own else kw.arg
                out += [("kw=" + label, line)] + self.expr(kw.value, line)
            return out + [(")", line)]
        if isinstance(node, ast.Lambda):
            return [("lambda", line)] + self.arguments(node.args, line) + self.expr(node.body, line)
        # every other expression: its type, then its children in order
        out = [(type(node).__name__, line)]
        for field, value in ast.iter_fields(node):
            if field == "ctx":
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.expr):
                    out += self.expr(child, line)
                elif isinstance(child, ast.comprehension):
                    out += [("for", line)] + self.expr(child.target, line) + self.expr(child.iter, line)
                    for cond in child.ifs:
                        out += [("if", line)] + self.expr(cond, line)
                elif isinstance(child, ast.keyword):
                    out += [("kw", line)] + self.expr(child.value, line)
                elif isinstance(child, ast.AST):
                    out += [(type(child).__name__, line)]
        return out

    @staticmethod
    def _chain(node, op):
        """The operands of a chain of one commutative operator: a + (b + c) + d -> a, b, c, d."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.BinOp) and isinstance(n.op, op):
                stack += [n.right, n.left]
            else:
                out.append(n)
        return out
