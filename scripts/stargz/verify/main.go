// estargz-verify: an independent reader's verdict on an eStargz blob, for the tests. It opens the blob
// with the estargz package (footer, TOC), checks the TOC against the digest the manifest's annotation
// gives, and reads every regular file through the TOC, checking each chunk against its chunkDigest and
// each file against its digest. Then it reads the blob again as the plain gzip tar an ordinary puller
// sees and checks that every tar entry is in the TOC with the same type, mode, owner, size, link and
// content. Prints a JSON summary; exits 1 with the first problem.
package main

import (
	"archive/tar"
	"compress/gzip"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	digest "github.com/opencontainers/go-digest"
)

type summary struct {
	TOCDigest        string `json:"toc_digest"`
	TarEntries       int    `json:"tar_entries"`
	RegularFiles     int    `json:"regular_files"`
	Chunks           int    `json:"chunks"`
	Landmark         string `json:"landmark"`
	PrefetchOffset   int64  `json:"prefetch_offset"`
	UncompressedSize int64  `json:"uncompressed_size"`
	DiffID           string `json:"diff_id"`
}

var tarTypes = map[byte]string{
	tar.TypeReg: "reg", tar.TypeDir: "dir", tar.TypeSymlink: "symlink", tar.TypeLink: "hardlink",
	tar.TypeChar: "char", tar.TypeBlock: "block", tar.TypeFifo: "fifo",
}

func main() {
	tocDigest := flag.String("toc-digest", "", "the layer descriptor's containerd.io/snapshot/stargz/toc.digest")
	flag.Parse()
	if flag.NArg() != 1 || *tocDigest == "" {
		fmt.Fprintln(os.Stderr, "usage: estargz-verify --toc-digest sha256:... BLOB")
		os.Exit(2)
	}
	file, err := os.Open(flag.Arg(0))
	if err != nil {
		fail(err)
	}
	defer file.Close()
	info, err := file.Stat()
	if err != nil {
		fail(err)
	}
	reader, err := estargz.Open(io.NewSectionReader(file, 0, info.Size()))
	if err != nil {
		fail(fmt.Errorf("not an eStargz blob: %w", err))
	}
	want, err := digest.Parse(*tocDigest)
	if err != nil {
		fail(err)
	}
	verifiers, err := reader.VerifyTOC(want)
	if err != nil {
		fail(err)
	}
	out := summary{TOCDigest: reader.TOCDigest().String()}
	for _, name := range []string{estargz.PrefetchLandmark, estargz.NoPrefetchLandmark} {
		if entry, ok := reader.Lookup(name); ok {
			out.Landmark, out.PrefetchOffset = name, entry.Offset
		}
	}

	// The blob as any gzip tar reader sees it, entry by entry against the TOC.
	gz, err := gzip.NewReader(io.NewSectionReader(file, 0, info.Size()))
	if err != nil {
		fail(err)
	}
	diff := digest.Canonical.Digester()
	counted := &countingReader{reader: io.TeeReader(gz, diff.Hash())}
	archive := tar.NewReader(counted)
	sawTOC := false
	for {
		header, err := archive.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			fail(fmt.Errorf("reading the blob as a tar: %w", err))
		}
		name := strings.TrimPrefix(path.Clean("/"+header.Name), "/")
		if sawTOC {
			fail(fmt.Errorf("%s comes after %s, which must be the last entry", name, estargz.TOCTarName))
		}
		if name == estargz.TOCTarName {
			sawTOC = true
			continue
		}
		out.TarEntries++
		if err := compare(reader, verifiers, name, header, archive, &out); err != nil {
			fail(fmt.Errorf("%s: %w", name, err))
		}
	}
	if !sawTOC {
		fail(fmt.Errorf("the tar has no %s entry", estargz.TOCTarName))
	}
	if _, err := io.Copy(io.Discard, counted); err != nil {
		fail(err)
	}
	out.UncompressedSize, out.DiffID = counted.n, diff.Digest().String()
	encoded, _ := json.Marshal(out)
	fmt.Println(string(encoded))
}

// compare checks one tar entry against its TOC entry and, for a regular file, its content as the TOC
// serves it (chunk by chunk, each verified) against the tar's.
func compare(reader *estargz.Reader, verifiers estargz.TOCEntryVerifier, name string, header *tar.Header,
	archive io.Reader, out *summary) error {
	entry, ok := reader.Lookup(name)
	if !ok {
		return fmt.Errorf("in the tar but not in the TOC")
	}
	if header.Typeflag == tar.TypeLink {
		// The reader resolves a hard link to the entry it names: the same one the target's name gives.
		target, ok := reader.Lookup(strings.TrimPrefix(path.Clean("/"+header.Linkname), "/"))
		if !ok || target != entry {
			return fmt.Errorf("the TOC does not resolve this hard link to %q", header.Linkname)
		}
		return nil
	}
	if kind := tarTypes[header.Typeflag]; entry.Type != kind {
		return fmt.Errorf("the TOC says %q, the tar %q", entry.Type, kind)
	}
	if entry.Mode != header.Mode || entry.UID != header.Uid || entry.GID != header.Gid {
		return fmt.Errorf("the TOC says mode %o uid %d gid %d, the tar mode %o uid %d gid %d",
			entry.Mode, entry.UID, entry.GID, header.Mode, header.Uid, header.Gid)
	}
	if entry.LinkName != header.Linkname || entry.DevMajor != int(header.Devmajor) || entry.DevMinor != int(header.Devminor) {
		return fmt.Errorf("the TOC says link %q device %d,%d, the tar link %q device %d,%d", entry.LinkName,
			entry.DevMajor, entry.DevMinor, header.Linkname, header.Devmajor, header.Devminor)
	}
	for key, value := range header.PAXRecords {
		if name, ok := strings.CutPrefix(key, "SCHILY.xattr."); ok && string(entry.Xattrs[name]) != value {
			return fmt.Errorf("the TOC's xattr %s is %q, the tar's %q", name, entry.Xattrs[name], value)
		}
	}
	if len(entry.Xattrs) != countXattrs(header) {
		return fmt.Errorf("the TOC has %d xattrs, the tar %d", len(entry.Xattrs), countXattrs(header))
	}
	if want := header.ModTime.Round(time.Second); header.ModTime.Unix() != 0 && !entry.ModTime().Equal(want) {
		return fmt.Errorf("the TOC's modtime %v, the tar's %v", entry.ModTime(), want)
	}
	if header.Typeflag != tar.TypeReg {
		return nil
	}
	out.RegularFiles++
	if entry.Size != header.Size {
		return fmt.Errorf("the TOC says %d bytes, the tar %d", entry.Size, header.Size)
	}
	fromTar := digest.Canonical.Digester()
	if _, err := io.Copy(fromTar.Hash(), archive); err != nil {
		return err
	}
	if header.Size == 0 {
		return nil
	}
	if entry.Digest != fromTar.Digest().String() {
		return fmt.Errorf("the TOC's digest %s, the tar's content %s", entry.Digest, fromTar.Digest())
	}
	content, err := reader.OpenFile(name)
	if err != nil {
		return err
	}
	// Chunk by chunk, each read whole (one decompression of its member), into its verifier and the file's hash.
	served := digest.Canonical.Digester()
	for offset := int64(0); offset < entry.Size; {
		chunk, ok := reader.ChunkEntryForOffset(name, offset)
		if !ok || chunk.ChunkOffset != offset {
			return fmt.Errorf("no chunk starts at offset %d", offset)
		}
		verifier, err := verifiers.Verifier(chunk)
		if err != nil {
			return err
		}
		data := make([]byte, chunk.ChunkSize)
		if _, err := content.ReadAt(data, chunk.ChunkOffset); err != nil && err != io.EOF {
			return err
		}
		_, _ = verifier.Write(data)
		if !verifier.Verified() {
			return fmt.Errorf("the chunk at offset %d does not match its chunkDigest", offset)
		}
		_, _ = served.Hash().Write(data)
		out.Chunks++
		offset += chunk.ChunkSize
	}
	if served.Digest().String() != entry.Digest {
		return fmt.Errorf("the content served through the TOC hashes to %s, not %s", served.Digest(), entry.Digest)
	}
	return nil
}

func countXattrs(header *tar.Header) int {
	n := 0
	for key := range header.PAXRecords {
		if strings.HasPrefix(key, "SCHILY.xattr.") {
			n++
		}
	}
	return n
}

type countingReader struct {
	reader io.Reader
	n      int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.reader.Read(p)
	c.n += int64(n)
	return n, err
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "estargz-verify:", err)
	os.Exit(1)
}
